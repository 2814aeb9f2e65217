"""Sequence packing (FrameworkSpec.packed_example_tokens): examples packed into each sequence with attention kept inside
each one (Transformer Engine's THD layout, Megatron-Bridge's packed_sequence_specs, NeMo's packed SFT / PEFT data).

Golden facts, from the sources:
- FlashAttention's variable-length kernels run each example's own causal triangle [FA, sec. 3.1 tiling]: examples of
  L tokens cost L/2 keys per query (plus half a tile on the diagonal), against s/2 for one causal document.
- The visible pairs of a causal example of L tokens are L(L+1)/2: (L+1)/2 per query (model FLOPs count them).
- Megatron's unfused attention takes no example boundaries (only TE's fused kernels run THD); DeepSpeed and the jax
  runner have no packed path here.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from autotune import api
from autotune.export import ExportRefused, export
from cli.main import app
from costmodels.specs import SpecError

runner = CliRunner()
PLAN = "tp=1,pp=1,dp=8,mbs=1,zero=1"


def _problem(n=0, seq=4096, **fw):
    return api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=32, seq_len=seq,
                             framework={"packed_example_tokens": n, **fw})


def _predict(problem, plan=PLAN):
    return api.predict_plan(problem, api.plan_from_text(plan, problem))


@pytest.mark.parametrize("L", [128, 512, 2048])
def test_packed_attention_flops_are_each_examples_causal_pairs(L):
    """Model FLOPs differ from unpacked ones by the attention core alone: 4 a d s per token and layer forward times
    3 (fwd + bwd), at (L+1)/2 instead of s/2 keys per query."""
    s, full, packed = 4096, _predict(_problem(0)), _predict(_problem(L))
    flops = lambda r: r["model_tflops_per_gpu"] * 1e12 * r["step_time_s"] * 8
    m = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=32, seq_len=s).model
    per_key = 3 * 2 * m.num_layers * m.num_attention_heads * 2 * m.head_dim_eff * 32 * s   # fwd+bwd, QK and PV
    assert flops(full) - flops(packed) == pytest.approx(per_key * (s / 2 - (L + 1) / 2), rel=1e-3)


@settings(max_examples=20, deadline=None)
@given(L=st.integers(16, 4096), seq=st.sampled_from([2048, 4096, 8192]))
def test_packing_never_slows_a_step_and_shorter_examples_are_never_slower(L, seq):
    L = min(L, seq)
    base = _predict(_problem(0, seq))["step_time_s"]
    t = _predict(_problem(L, seq))["step_time_s"]
    assert t <= base * (1 + 1e-6)
    assert _predict(_problem(max(L // 2, 1), seq))["step_time_s"] <= t * (1 + 1e-6)


@pytest.mark.parametrize("fw,reason", [
    ({"packed_example_tokens": 8192}, "do not fit in sequences"),
    ({"packed_example_tokens": -1}, "integer number of tokens"),
    ({"packed_example_tokens": 256, "attention_backend": "unfused"}, "fused attention kernel"),
    ({"packed_example_tokens": 256, "framework": "deepspeed"}, "Megatron-Core"),
])
def test_packing_refusals_name_the_field(fw, reason):
    with pytest.raises(SpecError, match=reason) as err:
        api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=32, seq_len=4096, framework=fw)
    assert err.value.field == "packed_example_tokens"


def test_only_the_bridge_export_and_no_jax_verify_take_packed_plans():
    p = _problem(256)
    plan = api.plan_from_text(PLAN, p)
    assert export("bridge", plan, p).text
    with pytest.raises(ExportRefused, match="packed sequences"):
        export("megatron", plan, p)
    from autotune.verify import verify_plan
    with pytest.raises(SpecError, match="unpacked sequences"):
        verify_plan(p, plan, gpu_key="h100", steps=1)


def test_cli_prints_the_packing_note():
    r = runner.invoke(app, ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--plan", PLAN,
                            "--global-batch", "32", "--seq-len", "4096", "--packed-example-tokens", "256"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())                    # rich wraps long lines
    assert "packed sequences" in out and "128 keys per query instead of 2,048" in out


@pytest.mark.parametrize("notes,tokens", [
    ("NeMo 25.02 LoRA fine-tuning (SQuAD v1.1 packed to 4096).", 240),
    ("SFT on squad, packed", 240),
    ("SFT fine-tuning (Dolly packed to 4096)", 0),          # a dataset without a known length: scored unpacked
    ("NeMo 24.07 pre-training.", 0),
])
def test_validate_reads_packing_from_the_notes_and_the_datasets_length(notes, tokens):
    from autotune.validate import PACKED_EXAMPLE_TOKENS, packed_example_tokens
    assert PACKED_EXAMPLE_TOKENS["squad"] == 240
    assert packed_example_tokens({"id": "x", "notes": notes}) == tokens


@pytest.mark.parametrize("cmd", [["explain", "--plan", PLAN], ["whatif", "--gpu", "b200"]])
def test_explain_and_whatif_print_the_packing_note(cmd):
    r = runner.invoke(app, [cmd[0], "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "32",
                            "--seq-len", "4096", "--packed-example-tokens", "256", *cmd[1:]])
    assert r.exit_code == 0, r.output
    assert "packed sequences" in " ".join(r.stdout.split())
