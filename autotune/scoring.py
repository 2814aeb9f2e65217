"""Score plans with the jitted cost model and turn results into report-ready dicts.

The hot path is `score_summary`: fixed-size padded chunks (so XLA compiles once per chunk size)
through one jitted function; only step time and peak memory come back to the host.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import pathlib
import pickle
import threading
import uuid

import numpy as np
import jax
from jax.experimental import serialize_executable

from costmodels import model as cm
from costmodels.breakdown import Memory, StepTime, flatten
from costmodels.encode import encode_cluster, encode_job, encode_model
from costmodels.params import EfficiencyParams
from costmodels.plan import PLAN_FIELDS, Plan, PlanBatch, microbatch_group_size
from costmodels.specs import SpecError
from search_spaces.space import Problem

from .files import writable_dir


def enable_compile_cache() -> str | None:
    """Keep XLA's compiled scorer on disk between processes (JAX's persistent compilation cache):
    the first run compiles (~2-6 s), later runs load it. AUTOTUNE_JAX_CACHE sets the folder;
    set it to an empty string to disable."""
    path = os.environ.get("AUTOTUNE_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "autotune", "jax"))
    if not path or not writable_dir(path):      # a read-only cache would warn on every compile
        return None
    try:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)   # also the op-by-op kernels of sensitivity
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    except (OSError, AttributeError):
        return None
    return path


# ---------------------------------------------------------------------------------------------
# Compiled scorers kept ahead of time
# ---------------------------------------------------------------------------------------------

#: (function, argument structure and types) -> its compiled executable, in this process
_COMPILED: dict = {}
#: signature -> (thread, result box) of a compile started ahead of its first use (`prefetch`)
_PENDING: dict = {}
#: the files whose code the compiled scorers run (their hash names the files on disk)
_CODE = ("costmodels", "autotune/scoring.py")


@functools.cache
def _code_hash() -> str:
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in _CODE:
        p = root / part
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _aot_path(sig: tuple) -> str | None:
    """Where the executable of `sig` is kept: next to JAX's persistent compilation cache (None when
    that cache is off). The name hashes the signature, the code, JAX's version, the device and XLA_FLAGS."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder:
        return None
    dev = jax.devices()[0]
    key = repr((sig, _code_hash(), jax.__version__, dev.platform, dev.device_kind, os.environ.get("XLA_FLAGS", "")))
    return os.path.join(folder, "autotune-aot", hashlib.sha256(key.encode()).hexdigest() + ".bin")


def _signature(name: str, args: tuple) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (name, str(tree), tuple((np.shape(x), np.result_type(x).str, isinstance(x, (bool, int, float)))
                                   for x in leaves))


def compiled(name: str, jitted, args: tuple):
    """The compiled executable of `jitted(*args)` for arguments of these shapes and types: from this
    process, else read from disk (`jax.experimental.serialize_executable`), else traced, lowered and
    compiled once (and written for the next process). A warm start skips JAX's tracing and lowering
    of the cost model (~0.5 s per scorer, which JAX's own cache cannot skip: its key is the lowered
    program). The file lives in the user's compilation cache folder, as JAX's executables do."""
    sig = _signature(name, args)
    hit = _COMPILED.get(sig)
    if hit is not None:
        return hit
    pending = _PENDING.pop(sig, None)
    if pending is not None:                    # started by `prefetch`: wait for it
        thread, box = pending
        thread.join()
        if box:
            _COMPILED[sig] = box[0]
            return box[0]
    exe = _load_or_compile(sig, jitted, args)
    _COMPILED[sig] = exe
    return exe


def _load_or_compile(sig: tuple, jitted, args: tuple):
    path = _aot_path(sig)
    exe = None
    if path and os.path.exists(path):
        try:
            with open(path, "rb") as f:
                exe = serialize_executable.deserialize_and_load(*pickle.load(f))
        except Exception:                   # unreadable, truncated or from another jaxlib: compile again
            exe = None
    if exe is None:
        exe = jitted.lower(*args).compile() if not path else _compile_and_keep(jitted, args, path)
    return exe


def _compile_and_keep(jitted, args: tuple, path: str):
    """Compile afresh and write the executable to `path` once a copy read back from its bytes has run.

    On the CPU backend an executable that JAX loaded from its own persistent cache serializes
    without its kernels (running the copy fails: NOT_FOUND: Function ... not found), so this compile
    must not come from that cache: the function is renamed with a nonce, which changes the lowered
    module's name and so JAX's cache key (JAX then stores that one entry too, unused). If the copy
    still fails, the executable serves this process only and nothing is written."""
    fn = getattr(jitted, "__wrapped__", jitted)

    def fresh(*a):
        return fn(*a)

    fresh.__name__ = fresh.__qualname__ = f"{fn.__name__.strip('_')}_aot_{uuid.uuid4().hex[:12]}"
    exe = jax.jit(fresh).lower(*args).compile()
    try:
        payload = serialize_executable.serialize(exe)
        jax.block_until_ready(serialize_executable.deserialize_and_load(*payload)(*args))
    except Exception:
        with contextlib.suppress(OSError):
            os.remove(path)
        return exe
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(payload, f)
        os.replace(tmp, path)                 # atomic: a concurrent reader sees all of it or nothing
    except OSError:
        pass                                  # a read-only or full disk: still scores, compiles next time
    return exe


def prefetch(name: str, jitted, args: tuple) -> None:
    """Start `compiled(name, jitted, args)` in a background thread, so that its compile (or read from
    disk) overlaps the caller's own work; XLA compiles without holding the GIL. The thread is a daemon:
    a process that ends first does not wait for it (the file is written atomically or not at all)."""
    sig = _signature(name, args)
    if sig in _COMPILED or sig in _PENDING:
        return
    box: list = []

    def work():
        with contextlib.suppress(Exception):     # a failed compile is retried, and reported, on first use
            box.append(_load_or_compile(sig, jitted, args))
    thread = threading.Thread(target=work, name=f"autotune-compile-{name}", daemon=True)
    _PENDING[sig] = (thread, box)
    thread.start()


@atexit.register
def _finish_prefetches() -> None:
    """Wait for the background compiles before the interpreter finalizes. A daemon thread still inside
    XLA's C++ compiler when Python tears down is ended by a forced unwind that aborts the whole process
    ("terminate called ... FATAL: exception not rethrown", exit 134): a command that stops early, e.g.
    with the one-line "no legal plan" error while the breakdown scorer compiles, lost its exit code 2.
    atexit callbacks run before finalization stops the daemon threads."""
    for thread, _ in list(_PENDING.values()):
        thread.join()


def run_compiled(name: str, jitted, args: tuple):
    """`jitted(*args)` through `compiled`; an executable read from disk that fails to run is deleted
    and the call falls back to `jitted` (a file another jaxlib wrote, a corrupt file)."""
    exe = compiled(name, jitted, args)
    try:
        return jax.block_until_ready(exe(*args))      # a bad executable fails here, not in the caller
    except Exception:
        sig = _signature(name, args)
        path = _aot_path(sig)
        _COMPILED.pop(sig, None)
        if path:
            with contextlib.suppress(OSError):
                os.remove(path)
        return jitted(*args)


CHUNK = 1 << 16
SMALL_CHUNK = 1 << 12
FULL_CHUNK = 128


class Inputs:
    """The encoded (array) form of a problem, built once per search."""

    def __init__(self, problem: Problem, memory_limit_gb: float | None = None):
        self.problem = problem
        self.model = encode_model(problem.model)
        self.hw = encode_cluster(problem.cluster)
        if memory_limit_gb is not None and not memory_limit_gb > 0:
            raise SpecError("memory_limit_gb", f"must be a positive number of GB, got {memory_limit_gb!r}")
        limit = memory_limit_gb * 1e9 if memory_limit_gb else None
        self.job = encode_job(problem.job, problem.cluster, limit)

    @property
    def memory_limit_bytes(self) -> float:
        return float(self.job["memory_limit"])


def _pad(arrays: dict, size: int) -> dict:
    n = len(arrays["tp"])
    if n == size:
        return arrays
    idx = np.concatenate([np.arange(n), np.zeros(size - n, dtype=np.int64)])
    return {k: np.asarray(v)[idx] for k, v in arrays.items()}


def with_groups(arrays: dict, inp: Inputs) -> dict:
    """The plans with their interleaving micro-batch groups (`plan.microbatch_group_size`), found on the host for
    the interleaved rows whose pp does not divide their micro-batches (integer arithmetic on those rows only): the
    cost model's own search over candidate groups (its fallback when the key is absent) would cost about as much
    as the rest of the scorer."""
    pp = arrays["pp"]
    group = pp.astype(np.float32)
    # gbs % (dp * mbs * pp) != 0: pp does not divide the micro-batches gbs / (dp * mbs), whole for legal plans
    per_group = arrays["dp"] * arrays["mbs"] * pp
    need = np.flatnonzero((int(round(float(inp.job["global_batch"]))) % np.maximum(per_group, 1) != 0)
                          & (arrays["vpp"] > 1))
    if need.size:
        m = int(round(float(inp.job["global_batch"]))) // np.maximum(arrays["dp"][need] * arrays["mbs"][need], 1)
        group[need] = microbatch_group_size(m, pp[need])
    return {**arrays, "mb_group": group}


def score_summary(batch: PlanBatch, inp: Inputs, params: EfficiencyParams,
                  chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """(step_time_s, mem_total_bytes) for every plan of the batch, in padded chunks."""
    n = len(batch)
    steps = np.empty(n, dtype=np.float32)
    mems = np.empty(n, dtype=np.float32)
    arrays = with_groups({f: np.asarray(batch[f], dtype=np.int32) for f in PLAN_FIELDS}, inp)
    size = chunk if n > SMALL_CHUNK else SMALL_CHUNK      # two shapes only: one compile each
    for start in range(0, n, size):
        stop = min(start + size, n)
        part = _pad({k: v[start:stop] for k, v in arrays.items()}, size)
        s, m = run_compiled("summary", cm.summary_jit, (part, inp.model, inp.hw, inp.job, params))
        steps[start:stop] = np.asarray(s)[: stop - start]
        mems[start:stop] = np.asarray(m)[: stop - start]
    return steps, mems


def _full_size(n: int) -> int:
    return FULL_CHUNK * int(np.ceil(max(n, 1) / FULL_CHUNK))


def prefetch_full(inp: Inputs, params: EfficiencyParams, n: int) -> None:
    """Compile (or load) the full-breakdown scorer `score_full` will use for `n` plans, in the
    background, while the caller enumerates and scores the space (a search's first run: ~3.5 s of
    XLA compile beside the summary scorer's ~1.4 s, on two cores)."""
    one = PlanBatch.from_plans([Plan()])
    part = with_groups(_pad({f: np.asarray(one[f], dtype=np.int32) for f in PLAN_FIELDS}, _full_size(n)), inp)
    prefetch("evaluate", cm.evaluate_jit, (part, inp.model, inp.hw, inp.job, params))


def score_full(batch: PlanBatch, inp: Inputs, params: EfficiencyParams) -> dict:
    """Every output of the cost model for a (small) batch, as numpy arrays."""
    n = len(batch)
    part = with_groups(_pad({f: np.asarray(batch[f], dtype=np.int32) for f in PLAN_FIELDS}, _full_size(n)), inp)
    out = flatten(run_compiled("evaluate", cm.evaluate_jit, (part, inp.model, inp.hw, inp.job, params)))
    return {k: np.asarray(v)[:n] for k, v in out.items()}


#: breakdown part -> key of `score_full`'s flat dict (the parts of StepTime / Memory)
TIME_KEYS = {name: f"time.{name}" for name in StepTime._fields}
MEM_KEYS = {name: f"memory.{name}" for name in Memory._fields if name != "total"}


def plan_report(plan: Plan, out: dict, i: int, inp: Inputs) -> dict:
    """The JSON of one scored plan (the contract of `predict --json` and of search's `top`)."""
    prob = inp.problem
    n_gpus = prob.cluster.num_gpus
    step = float(out["step_time_s"][i])
    peak = float(inp.job["peak_gemm"])
    mem_total = float(out["memory.total"][i])
    limit = inp.memory_limit_bytes
    tokens = prob.job.tokens_per_step
    return {
        "plan": plan.as_dict(),
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_gpu": tokens / step / n_gpus,
        "model_tflops_per_gpu": float(out["model_flops"][i]) / step / n_gpus / 1e12,
        "mfu": float(out["model_flops"][i]) / step / n_gpus / peak,
        "hfu": float(out["hw_flops"][i]) / step / n_gpus / peak,
        "fits": bool(mem_total <= limit),
        "memory_gb": {"total": mem_total / 1e9,
                      **{k: float(out[v][i]) / 1e9 for k, v in MEM_KEYS.items()},
                      "limit": limit / 1e9},
        "time_breakdown_s": {k: float(out[v][i]) for k, v in TIME_KEYS.items()},
        "micro_batches": int(round(float(out["micro_batches"][i]))),
    }


def block_until_ready(x):
    return jax.block_until_ready(x)
