"""Memory under the framework options of issue 14's runner comparison, against the papers' own accounting
(never the cost model's output):

[K22] Korthikanti et al. 2022 sec. 4.1: per layer and micro-batch, 34sbh + 5as^2b bytes with dropout, of which
  dropout accounts for sbh (attention-output dropout mask) + sbh (MLP-output dropout mask) + as^2b (softmax
  dropout mask) + 2as^2b (softmax dropout output); without dropout those 2sbh + 3as^2b are not kept.
[N21] Narayanan et al. 2021 sec. 2.2: 1F1B keeps at most p micro-batches in flight on the first stage;
[H19] Huang et al. 2019 (GPipe) sec. 2.3: all m micro-batches' activations until the backward pass.
[Z20] Rajbhandari et al. 2020 sec. 3: mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter; fp32 training
  (Megatron-LM without --bf16, its FP32Optimizer) keeps fp32 weights (4) and Adam's two moments (8).
"""
from __future__ import annotations

import json

import pytest

from autotune.api import build_problem, predict_plan
from autotune.export import ExportRefused, export
from costmodels.plan import Plan

H, A, S, LAYERS = 1024, 16, 2048, 8


def _gpt(tmp_path, dropout: float, vocab: int = 51200) -> str:
    cfg = {"model_type": "gpt2", "n_layer": LAYERS, "n_embd": H, "n_head": A, "n_inner": None, "n_positions": S,
           "vocab_size": vocab, "resid_pdrop": dropout}
    path = tmp_path / f"gpt-{dropout}-{vocab}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _mem(model, plan, gpus=1, gb=8, precision="bf16", **framework):
    problem = build_problem(model=model, gpu="a100-80gb", gpus=gpus, global_batch=gb, seq_len=S,
                            precision=precision, framework={"attention_backend": "unfused", **framework})
    return predict_plan(problem, Plan.from_dict(plan), memory_limit_gb=1e9)["memory_gb"]


def test_unfused_attention_without_dropout_keeps_only_the_softmax_output(tmp_path):
    plan = dict(tp=1, pp=1, dp=1, mbs=1, recompute="none", sp=False, zero=0)
    with_dropout = _mem(_gpt(tmp_path, 0.1), plan)["activations"]
    without = _mem(_gpt(tmp_path, 0.0), plan)["activations"]
    b = 1
    expected_gb = LAYERS * (2 * S * b * H + 3 * A * S * S * b) / 1e9      # [K22 sec. 4.1]
    assert with_dropout - without == pytest.approx(expected_gb, rel=1e-4)


def test_gpipe_keeps_every_micro_batch_where_1f1b_keeps_pp(tmp_path):
    # 4 stages, 16 micro-batches; a small vocabulary so that the last stage's logits do not decide the peak
    model = _gpt(tmp_path, 0.0, vocab=256)
    plan = dict(tp=1, pp=4, dp=1, mbs=1, recompute="none", sp=False, zero=0)
    one_f_one_b = _mem(model, plan, gpus=4, gb=16)["activations"]
    gpipe = _mem(model, plan, gpus=4, gb=16, pipeline_schedule="gpipe")["activations"]
    assert gpipe / one_f_one_b == pytest.approx(16 / 4, rel=0.03)           # m / p [H19], [N21]


def test_1f1b_stays_the_default(tmp_path):
    model = _gpt(tmp_path, 0.0)
    plan = dict(tp=1, pp=4, dp=1, mbs=1, recompute="none", sp=False, zero=0)
    assert _mem(model, plan, gpus=4, gb=16) == _mem(model, plan, gpus=4, gb=16, pipeline_schedule="1f1b")


def test_fp32_training_state_bytes(tmp_path):
    model = _gpt(tmp_path, 0.0)
    plan = dict(tp=1, pp=1, dp=1, mbs=1, recompute="none", sp=False, zero=0)
    bf16, fp32 = _mem(model, plan), _mem(model, plan, precision="fp32")
    assert fp32["weights"] / bf16["weights"] == pytest.approx(4 / 2)         # [Z20]: 4 vs 2 bytes
    assert fp32["optimizer"] / bf16["optimizer"] == pytest.approx(8 / 12)    # Adam moments vs + master
    assert fp32["gradients"] == pytest.approx(bf16["gradients"])             # fp32 main gradients in both


def test_microbatch_grad_buffer_adds_one_gradient_in_the_weights_dtype(tmp_path):
    model = _gpt(tmp_path, 0.0)
    plan = dict(tp=1, pp=1, dp=1, mbs=1, recompute="none", sp=False, zero=0)        # 8 micro-batches
    base, buf = _mem(model, plan), _mem(model, plan, microbatch_grad_buffer=True)
    # fp32 main gradients are 4 bytes per parameter, the extra buffer 2 (bf16 weights)
    assert buf["gradients"] / base["gradients"] == pytest.approx(1 + 2 / 4)


def test_exporters_refuse_what_their_framework_cannot_run(tmp_path):
    model = _gpt(tmp_path, 0.0)
    plan = Plan.from_dict(dict(tp=1, pp=2, dp=1, mbs=1, recompute="none", sp=False, zero=0))
    gp = build_problem(model=model, gpu="a100-80gb", gpus=2, global_batch=8, seq_len=S,
                       framework={"pipeline_schedule": "gpipe"})
    for target in ("megatron", "bridge"):
        with pytest.raises(ExportRefused, match="pipeline_schedule=gpipe"):
            export(target, plan, gp)
    assert 'pipeline_parallel_schedule = "GPipe"' in export("torchtitan", plan, gp).text
    fp32 = build_problem(model=model, gpu="a100-80gb", gpus=2, global_batch=8, seq_len=S, precision="fp32")
    assert "--bf16" not in export("megatron", plan, fp32).text                  # fp32 is Megatron's default
    with pytest.raises(ExportRefused, match="precision=fp32"):
        export("bridge", plan, fp32)
