"""The compiled scorers kept on disk (`autotune.scoring.compiled`, issue 9): a warm start reads the
executable instead of tracing and lowering the cost model; the scores are the same, and a bad file is
dropped and the scorer compiled again."""
from __future__ import annotations

import numpy as np

from autotune import scoring
from autotune.api import build_problem
from costmodels.params import EfficiencyParams
from search_spaces.space import enumerate_legal


def _case():
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=256, seq_len=4096)
    batch = next(enumerate_legal(problem)[0])
    return scoring.Inputs(problem), batch.select(np.arange(min(len(batch), 300)))


def test_executable_on_disk_gives_the_same_scores_and_a_bad_file_is_replaced(tmp_path, monkeypatch):
    inp, batch = _case()
    params = EfficiencyParams()
    reference = scoring.score_summary(batch, inp, params)          # in-process (the usual path)
    full_ref = scoring.score_full(batch.select(np.arange(5)), inp, params)
    paths: dict = {}
    monkeypatch.setattr(scoring, "_aot_path", lambda sig: paths.setdefault(sig, str(tmp_path / f"{len(paths)}.bin")))
    monkeypatch.setattr(scoring, "_COMPILED", {})
    fresh = scoring.score_summary(batch, inp, params)               # compiled, then written
    files = sorted(tmp_path.glob("*.bin"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    monkeypatch.setattr(scoring, "_COMPILED", {})
    loaded = scoring.score_summary(batch, inp, params)              # read back: no tracing
    for got in (fresh, loaded):
        np.testing.assert_array_equal(got[0], reference[0])
        np.testing.assert_array_equal(got[1], reference[1])
    full = scoring.score_full(batch.select(np.arange(5)), inp, params)
    assert sorted(full) == sorted(full_ref) and all(np.array_equal(full[k], full_ref[k]) for k in full)
    files[0].write_bytes(b"not an executable")                      # corrupt: compiled again, rewritten
    monkeypatch.setattr(scoring, "_COMPILED", {})
    again = scoring.score_summary(batch, inp, params)
    np.testing.assert_array_equal(again[0], reference[0])
    assert files[0].read_bytes() != b"not an executable"


def test_no_cache_folder_keeps_executables_in_memory_only(monkeypatch, tmp_path):
    monkeypatch.setattr(scoring, "_aot_path", lambda sig: None)
    monkeypatch.setattr(scoring, "_COMPILED", {})
    inp, batch = _case()
    scoring.score_summary(batch, inp, EfficiencyParams())
    assert len(scoring._COMPILED) == 1 and not any(tmp_path.iterdir())


def test_an_executable_that_fails_to_run_is_deleted_and_the_jit_answers(tmp_path, monkeypatch):
    inp, batch = _case()
    params = EfficiencyParams()
    reference = scoring.score_summary(batch, inp, params)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"x")
    monkeypatch.setattr(scoring, "_aot_path", lambda sig: str(bad))

    def broken(*args):
        raise RuntimeError("NOT_FOUND: Function fusion not found")

    monkeypatch.setattr(scoring, "compiled", lambda name, jitted, args: broken)
    got = scoring.score_summary(batch, inp, params)
    np.testing.assert_array_equal(got[0], reference[0])
    assert not bad.exists()


def test_a_prefetched_scorer_is_the_one_score_full_uses_and_scores_the_same(monkeypatch):
    """`prefetch_full` compiles the breakdown scorer in a thread; `score_full` waits for that very
    executable (no second compile) and its scores equal the direct path's."""
    inp, batch = _case()
    params = EfficiencyParams()
    five = batch.select(np.arange(5))
    reference = scoring.score_full(five, inp, params)
    monkeypatch.setattr(scoring, "_aot_path", lambda sig: None)
    monkeypatch.setattr(scoring, "_COMPILED", {})
    monkeypatch.setattr(scoring, "_PENDING", {})
    scoring.prefetch_full(inp, params, 5)
    assert len(scoring._PENDING) == 1
    ((thread, box),) = scoring._PENDING.values()
    thread.join()
    got = scoring.score_full(five, inp, params)
    assert not scoring._PENDING and len(scoring._COMPILED) == 1
    assert next(iter(scoring._COMPILED.values())) is box[0]
    assert all(np.array_equal(got[k], reference[k]) for k in reference)


def test_a_prefetch_that_fails_leaves_the_first_use_to_compile(monkeypatch):
    inp, batch = _case()
    params = EfficiencyParams()
    monkeypatch.setattr(scoring, "_aot_path", lambda sig: None)
    monkeypatch.setattr(scoring, "_COMPILED", {})
    monkeypatch.setattr(scoring, "_PENDING", {})

    class Broken:                                  # lowering fails in the background thread
        def lower(self, *a):
            raise RuntimeError("no")
    scoring.prefetch("evaluate", Broken(), (batch.arrays, inp.model, inp.hw, inp.job, params))
    ((thread, box),) = scoring._PENDING.values()
    thread.join()
    assert box == []
    out = scoring.score_full(batch.select(np.arange(3)), inp, params)   # another shape: compiled on use
    assert np.all(np.isfinite(out["step_time_s"]))


EXIT_WHILE_COMPILING = """
import sys
import time
from autotune import scoring
from autotune.api import build_problem
from costmodels.params import EfficiencyParams
inp = scoring.Inputs(build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096))
scoring.prefetch_full(inp, EfficiencyParams(), 8)
time.sleep(1.0)      # past the tracing, into XLA's compile (~3 s cold on two cores)
sys.exit(2)          # as a command that stops early does (the one-line "no legal plan" error, exit 2)
"""


def test_a_process_that_exits_while_a_scorer_compiles_keeps_its_exit_code(tmp_path):
    """A background compile still inside XLA when Python finalizes used to abort the process ("terminate
    called ... FATAL: exception not rethrown", exit 134) instead of exiting with the command's code; an empty
    compilation cache makes the compile cold, so the exit lands mid-compile every time."""
    import os
    import subprocess
    import sys
    for i in range(2):
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / f"cache{i}"), "JAX_PLATFORMS": "cpu"}
        r = subprocess.run([sys.executable, "-c", EXIT_WHILE_COMPILING], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "terminate called" not in r.stderr and "FATAL" not in r.stderr
