"""Low-precision primary weights (Megatron's --fp8-param-gather / --fp4-param-gather).

Golden facts, from the code and the formats:
- Megatron-LM arguments.py: "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron
  fsdp"; "--fp4-param-gather must be used together with --fp4-format"; transformer_config.py: "fp8_param must be
  used together with fp8 mode".
- The distributed optimizer / FSDP all-gathers the primary weights in their own dtype: fp8 is 1 B per parameter,
  NVFP4 0.5 B plus one E4M3 scale per 16 values (0.5625 B), bf16 2 B, fp32 4 B.
- Megatron-Bridge's nvfp4 preset sets fp4_param_gather=True and is applied over the model / ddp configs at runtime.
"""
from __future__ import annotations

import pytest

from autotune import api
from autotune.export import ExportRefused, export
from costmodels.encode import encode_job
from costmodels.plan import Plan
from costmodels.presets import build_cluster
from costmodels.specs import SpecError


def _problem(precision="fp8", gpu="b200", gather=False, model="llama3-8b", gpus=8, **fw):
    return api.build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=64, seq_len=4096, precision=precision,
                             framework={"fp8_param_gather": gather, **fw})


@pytest.mark.parametrize("precision,gather,golden", [
    ("bf16", False, 2.0), ("fp32", False, 4.0), ("fp8", False, 2.0), ("fp8", True, 1.0), ("fp4", True, 0.5625),
])
def test_primary_weight_bytes(precision, gather, golden):
    problem = _problem(precision, gather=gather)
    J = encode_job(problem.job, build_cluster(gpu="b200", num_gpus=8))
    assert float(J["primary_weight_bytes"]) == golden


def test_fp8_primary_weights_halve_the_parameter_gather_and_the_weights():
    plan = "tp=1,pp=1,dp=8,mbs=1,zero=1"
    kw = dict(overlap_param_gather=False)          # the gather after the optimizer step, exposed whole
    bf16 = api.predict_plan(_problem(**kw), api.plan_from_text(plan, _problem(**kw)))
    fp8 = api.predict_plan(_problem(gather=True, **kw), api.plan_from_text(plan, _problem(gather=True, **kw)))
    assert fp8["time_breakdown_s"]["dp_comm"] < bf16["time_breakdown_s"]["dp_comm"]
    params = _problem().model.param_counts()["total"]
    assert bf16["memory_gb"]["weights"] - fp8["memory_gb"]["weights"] == pytest.approx(params / 1e9, rel=0.01)


@pytest.mark.parametrize("zero,ok", [(0, False), (1, True), (3, True)])
def test_megatron_gathers_low_precision_weights_only_when_sharded(zero, ok):
    problem = _problem(gather=True)
    text = f"tp=1,pp=1,dp=8,mbs=1,zero={zero}"
    if ok:
        assert api.plan_from_text(text, problem).zero == zero
    else:
        with pytest.raises(SpecError, match="param_gather_needs_sharding"):
            api.plan_from_text(text, problem)


def test_the_search_never_picks_an_unsharded_plan_with_fp8_weights():
    result = api.search(_problem(gather=True, model="llama3-8b", gpus=16), top_k=50)
    assert len(result.top) == 50
    assert {row["plan"]["zero"] for row in result.top} <= {1, 3}
    assert result.space["illegal"].get("param_gather_needs_sharding", 0) > 0


def test_fp4_exports_its_own_flag_and_preset():
    plan = Plan(tp=1, pp=1, dp=8, mbs=1, zero=1)
    argv = export("megatron", plan, _problem("fp4", gather=True)).text.split()
    assert "--fp4-param-gather" in argv and "--fp8-param-gather" not in argv
    assert "--fp8-param-gather" in export("megatron", plan, _problem("fp8", gather=True)).text.split()
    assert "mixed_precision=bf16_with_nvfp4_mixed" in export("bridge", plan, _problem("fp4", gather=True)).text.split()
    with pytest.raises(ExportRefused, match="fp8_param_gather"):
        export("bridge", plan, _problem("fp4", gather=False))
