"""RoPE that Megatron must run unfused: YaRN-scaled RoPE as its own position embedding (GPT-OSS).

Golden values are counted from Megatron-Core's unfused path (megatron/core/models/common/embeddings/
rope_utils.py `_apply_rotary_pos_emb_bshd`, per query or key tensor of N bf16 elements):
forward  cos, sin, x mscale (2), .to(bf16) (2) on the small frequency table; t * cos (N read, N written),
         neg of one half (N/2, N/2), cat (N, N), * sin (N, N), add (2N, N), cat with t_pass (N, N)
         -> 12 kernels, 24N bytes; the fused kernel: 1 kernel, 4N bytes
backward grad * sin and grad * cos (N, N each), neg (N/2, N/2), the chunk's cat (N, N), the two paths'
         sum (2N, N), the slice's zeros (N) and copy (N, N) -> 7 kernels, 26N bytes; fused: 1 kernel, 4N
Per layer (query and key) that is 22 + 12 launches more and 20 + 22 bytes more per rotated element.
Which models: Megatron-Bridge keeps apply_rope_fusion only for position_embedding_type "rope"
(utils/fusions.py validate_rope_fusion_compatibility); its GPT-OSS provider sets "yarn"; DeepSeek's
MLA applies YaRN inside "rope" and fuses it.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from autotune.api import build_problem, predict_plan
from autotune.export import export
from costmodels import compute
from costmodels.encode import encode_model
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan
from costmodels.presets import MODEL_PRESETS, model_from_hf_config

GPT_OSS_CFG = {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 2880, "intermediate_size": 2880,
               "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 8,
               "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
               "rope_scaling": {"rope_type": "yarn", "factor": 32.0}}


@pytest.mark.parametrize("cfg, expected", [
    (GPT_OSS_CFG, "yarn"),
    ({k: v for k, v in GPT_OSS_CFG.items() if k != "rope_scaling"}, "yarn"),     # GptOssConfig's default
    ({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
      "num_attention_heads": 4, "vocab_size": 1000, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope"),
    ({"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
      "num_attention_heads": 4, "vocab_size": 1000, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
      "qk_rope_head_dim": 16, "v_head_dim": 32, "rope_scaling": {"type": "yarn", "factor": 40}}, "rope"),
    ({"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1000}, "learned_absolute"),
])
def test_the_position_embedding_megatron_builds(cfg, expected):
    assert model_from_hf_config(cfg, "m").position_embedding == expected


def test_gpt_oss_preset_is_yarn():
    assert MODEL_PRESETS["gpt-oss-120b"].position_embedding == "yarn"


def test_unfused_rope_costs_the_counted_bytes_and_launches():
    M = encode_model(model_from_hf_config(GPT_OSS_CFG, "oss"))
    assert float(M["rope_unfused"]) == 1.0 and float(M["rope_elems"]) == (64 + 8) * 64
    S = SimpleNamespace(tokens=np.float32(4096.0), tp=np.float32(2.0), cp=np.float32(1.0))
    H = {"hbm_bw": 3.35e12}
    e = EfficiencyParams(hbm_eff=0.9)
    eager, xla = {"compiled_step": 0.0}, {"compiled_step": 1.0}
    # forward + twice the forward (the backward) = the counted 20 + 22 bytes per rotated element
    t = float(compute.rope_unfused_s(S, M, H, eager, e))
    assert 3 * t == pytest.approx(4096 * (64 + 8) * 64 / 2 * (20 + 22) / (3.35e12 * 0.9), rel=1e-5)
    # forward + one backward's worth on the host = the counted 22 + 12 launches
    assert 2 * compute.ROPE_UNFUSED_EXTRA_LAUNCHES == 22 + 12
    assert float(compute.rope_unfused_s(S, M, H, xla, e)) == 0.0          # XLA fuses elementwise chains


def _step_s(model, framework=None):
    problem = build_problem(model=model, gpu="h100", gpus=64, global_batch=256, seq_len=4096, framework=framework)
    return predict_plan(problem, Plan(tp=1, pp=4, dp=16, ep=8, mbs=1))["step_time_s"]


def test_yarn_gpt_oss_takes_longer_than_the_same_model_with_fused_rope(tmp_path):
    import json
    yarn, rope = tmp_path / "yarn.json", tmp_path / "rope.json"
    cfg = {**GPT_OSS_CFG, "num_hidden_layers": 36, "num_local_experts": 128}
    yarn.write_text(json.dumps(cfg))
    rope.write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "default"}}))
    assert _step_s(str(yarn)) > _step_s(str(rope)) * 1.01
    assert _step_s(str(yarn), framework={"framework": "jax"}) == pytest.approx(_step_s(str(rope), framework={"framework": "jax"}), rel=1e-6)


def _megatron_args(model, ep=8):
    problem = build_problem(model=model, gpu="h100", gpus=64, global_batch=256, seq_len=4096)
    return [t for t in export("megatron", Plan(tp=1, pp=4, dp=16, ep=ep, mbs=1), problem).text.split() if t != "\\"]


def test_the_megatron_export_runs_the_window_and_rope_the_model_costs():
    args = " ".join(_megatron_args("gpt-oss-120b"))
    # Megatron's TransformerLayer: window on layer_number % 2 != 0 (1-based) = GPT-OSS's even 0-based layers
    assert "--window-size 128,0" in args and "--window-attn-skip-freq 2" in args
    assert "--rope-type yarn" in args and "--no-rope-fusion" in args
    llama = " ".join(_megatron_args("llama3-8b", ep=1))
    assert "--window-size" not in llama and "--no-rope-fusion" not in llama


def test_predict_says_the_rope_is_unfused():
    from typer.testing import CliRunner
    from cli.main import app
    args = ["predict", "--model", "gpt-oss-120b", "--gpu", "h100", "--gpus", "64", "--global-batch", "256",
            "--seq-len", "4096", "--plan", "tp=1,pp=4,dp=16,ep=8,mbs=1"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code in (0, 3) and "YaRN-scaled RoPE, which Megatron runs unfused" in out.stdout
    jax = CliRunner().invoke(app, args + ["--framework", "jax"])
    assert "YaRN" not in jax.stdout
