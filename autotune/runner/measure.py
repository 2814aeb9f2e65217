"""Run a sharded model for a few steps and measure it: step time, peak memory, tokens/s, TFLOP/s.

Step time: the median of `steps` timed optimizer steps after `warmup` untimed ones (the first call
compiles and is timed separately as compile_s); spread = (max - min) / median. Peak memory per
device: the devices' own counter (`memory_stats()["peak_bytes_in_use"]`, GPU) when they have one,
else XLA's compiled memory analysis of the step (arguments + outputs - aliased + temporaries: the
buffer assignment of one device's program). Model FLOPs: Narayanan et al. 2021 eq. 3 without the
recomputation pass, i.e. 3 x (2 x matmul weights per token + 4 s a d per token per layer for
attention scores and values + 2 h V for the head) (also Chowdhery et al. 2022 app. B).
"""
from __future__ import annotations

import glob
import os
import re
import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from . import model as M
from .sharded import RunShape, ShardedModel

#: substrings of XLA's out-of-memory errors (the BFC allocator's and the PJRT client's)
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")


def model_flops_per_step(dm: M.Dims, seq_len: int, global_batch: int) -> float:
    h, a, g, d = dm.hidden, dm.heads, dm.kv_heads, dm.head_dim
    attn_w = h * (a + 2 * g) * d + a * d * h
    if dm.is_moe:
        mlp_w = dm.top_k * 3 * h * dm.expert_ffn + dm.num_shared_experts * 3 * h * dm.shared_ffn + h * dm.num_experts
    else:
        mlp_w = 3 * h * dm.ffn
    per_token = dm.num_layers * (2 * (attn_w + mlp_w) + 4 * seq_len * a * d) + 2 * h * dm.vocab
    return 3.0 * per_token * seq_len * global_batch


@dataclass(frozen=True, kw_only=True)
class Measured:
    status: str                         # ok | oom | interrupted | error
    step_times_s: tuple = ()
    compile_s: float = 0.0
    peak_bytes_per_device: float = 0.0
    memory_source: str = ""
    xla_memory: dict | None = None      # XLA's compiled memory analysis of one device (bytes)
    losses: tuple = ()
    error: str = ""

    @property
    def step_time_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None

    @property
    def spread(self) -> float | None:
        if len(self.step_times_s) < 2:
            return None
        return (max(self.step_times_s) - min(self.step_times_s)) / statistics.median(self.step_times_s)


def xla_memory_analysis(compiled) -> dict | None:
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    out = {k: float(getattr(ma, k + "_in_bytes", 0) or 0)
           for k in ("argument_size", "output_size", "alias_size", "temp_size", "generated_code_size")}
    out["peak"] = out["argument_size"] + out["output_size"] - out["alias_size"] + out["temp_size"]
    return out


#: the line of XLA's live-range dump (--xla_dump_to, *-live-range.txt) that totals the buffers live at the
#: program's peak: parameters, outputs and temporaries, before they are packed into one block
_LIVE_PEAK_LINE = re.compile(r"Stack trace breakdown for peak usage:\s*([0-9 ,]+)\s*bytes")
#: the values listed live at that peak ("  name{index}: N bytes (cumulative ...)")
_LIVE_VALUE = re.compile(r"^\s+(\S+?)\{([0-9,]*)\}: (\d+) bytes", re.M)
#: a value of the buffer assignment (*-buffer-assignment.txt) and the slice of its allocation
_BA_VALUE = re.compile(r"^\s*value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")


def _double_counted_bytes(live_text: str, assignment_path: str) -> float:
    """Bytes that XLA's peak list counts twice: values that share one slice of an allocation (an
    in-place update's operand and result, a while loop's carried buffer inside and outside the body)
    are listed once each though they are one buffer. Each (allocation, offset) is counted once."""
    if "(peak):" not in live_text or not os.path.exists(assignment_path):
        return 0.0
    where, alloc = {}, None
    with open(assignment_path, encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("allocation "):
                alloc = int(line.split()[1].rstrip(":"))
                continue
            m = _BA_VALUE.match(line)
            if m and alloc is not None:
                where[m.group(1)] = (alloc, int(m.group(3)))
    peak = live_text.split("(peak):", 1)[1].split("Stack trace breakdown", 1)[0]
    seen, extra = {}, 0.0
    for name, index, size in _LIVE_VALUE.findall(peak):
        key = where.get(name + (f"{{{index}}}" if index else ""))
        if key is None:
            continue
        if key in seen:
            extra += min(seen[key], int(size))
            seen[key] = max(seen[key], int(size))
        else:
            seen[key] = int(size)
    return extra


def live_peak_bytes(dump_dir: str, module: str = "jit_fn") -> float | None:
    """The most bytes live at once in the newest compiled `module` dumped to `dump_dir` (XLA_FLAGS
    --xla_dump_to=DIR --xla_dump_hlo_as_text): what the program needs before XLA's heap simulator
    packs the temporaries into one block of temp_size (that block is larger by the packing's gaps).
    A buffer that two values share (an in-place dynamic-update-slice of a loop-carried buffer: its
    operand and its result) is counted once; XLA's report lists both at its peak."""
    files = glob.glob(os.path.join(dump_dir, f"*.{module}.*live-range.txt"))
    if not files:
        return None
    path = max(files, key=os.path.getmtime)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    m = _LIVE_PEAK_LINE.search(text)
    if not m:
        return None
    assignment = path.replace("-live-range.txt", "-buffer-assignment.txt")
    return float(re.sub(r"[ ,]", "", m.group(1))) - _double_counted_bytes(text, assignment)


def compiled_memory(shape: RunShape, devices) -> dict | None:
    """XLA's memory analysis of one device's compiled training step, without running or allocating."""
    sm = ShardedModel(shape, devices)
    return xla_memory_analysis(sm.jitted_step().lower(*sm.abstract_inputs()).compile())


def device_peak_bytes(devices) -> float | None:
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:                 # noqa: BLE001  (backends without the counter raise)
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(float(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def is_oom(exc: BaseException) -> bool:
    return any(m in str(exc) for m in OOM_MARKERS)


def synthetic_batch(shape: RunShape, seed: int = 0):
    """Random token ids (like Megatron's --mock-data): inputs and next-token targets."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, shape.dims.vocab, (shape.global_batch, shape.seq_len + 1), dtype=np.int32)
    return jnp.asarray(tok[:, :-1]), jnp.asarray(tok[:, 1:])


def measure(shape: RunShape, devices, *, steps: int, warmup: int = 1, on_step=None) -> Measured:
    """Build, compile and run `warmup + steps` optimizer steps. An out-of-memory error (at compile or
    run time) returns status "oom"; Ctrl-C returns what was timed so far with status "interrupted"."""
    times, losses, xla_mem, compile_s = [], [], None, 0.0
    sm = ShardedModel(shape, devices)
    used = list(sm.mesh.devices.flat)
    before = device_peak_bytes(used)      # the counter is a high-water mark since the process started
    try:
        state = sm.init_state_random(0)
        tokens, targets = sm.split_batch(*synthetic_batch(shape))
        t0 = time.perf_counter()
        compiled = sm.jitted_step().lower(state, tokens, targets).compile()
        compile_s = time.perf_counter() - t0
        xla_mem = xla_memory_analysis(compiled)
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            state, met = compiled(state, tokens, targets)
            loss = float(jax.block_until_ready(met["loss"]))
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
                losses.append(loss)
                if on_step:
                    on_step(i - warmup + 1, dt)
        status, err = "ok", ""
    except KeyboardInterrupt:
        status, err = "interrupted", "stopped by Ctrl-C"
    except Exception as exc:              # noqa: BLE001  (XLA raises its runtime error type)
        if not is_oom(exc):
            raise
        status, err = "oom", " ".join(str(exc).split())[:300]
    peak = device_peak_bytes(used)
    source = "device memory_stats peak_bytes_in_use"
    if peak is None:
        peak, source = (xla_mem or {}).get("peak", 0.0), "XLA compiled memory analysis"
    elif before is not None and before > 0 and peak <= before:
        # an earlier run in this process set the high-water mark, so this run's own peak is unknown
        peak, source = (xla_mem or {}).get("peak", 0.0), ("XLA compiled memory analysis (the device's peak counter "
                                                          "still holds an earlier run's higher peak)")
    return Measured(status=status, step_times_s=tuple(times), compile_s=compile_s, peak_bytes_per_device=peak,
                    memory_source=source, xla_memory=xla_mem, losses=tuple(losses), error=err)
