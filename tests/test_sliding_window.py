"""Sliding-window attention: which layers use the window (read from config.json as transformers does) and
what a fused attention kernel computes on them.

Golden values: the layer patterns the model reports publish (Gemma 2 report, arXiv:2408.00118 sec. 2:
local and global layers alternate; Gemma 3 report, arXiv:2503.19786 sec. 2: 5 local layers per global
one; gpt-oss model card, arXiv:2508.10925 sec. 2.1: alternating banded-window (128 tokens) and dense
layers), and a brute-force count of the 128 x 128 key blocks a tiled kernel must compute under the
mask (FlashAttention-2 sec. 3.1): no figure comes from this code's own output.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from autotune.api import build_problem, predict_plan
from autotune.validate import model_from_row
from cli.main import app
from costmodels.compute import FLASH_KEY_BLOCK, fused_attention_keys_per_query
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan
from costmodels.presets import MODEL_PRESETS, model_from_hf_config
from costmodels.specs import ModelSpec, Recompute, SpecError

runner = CliRunner()

GEMMA2_9B = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
             "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
             "max_position_embeddings": 8192, "sliding_window": 4096}
# google/gemma-3-4b-it: the text model's keys that differ from Gemma3TextConfig's defaults
GEMMA3_4B = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                                                     "intermediate_size": 10240, "num_hidden_layers": 34,
                                                     "sliding_window": 1024}}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000,
              "max_position_embeddings": 32768, "sliding_window": 4096}


@pytest.mark.parametrize("cfg, window, sliding, layers", [
    (GEMMA2_9B, 4096, 21, 42),                   # alternating: half the layers local
    (GEMMA3_4B, 1024, 29, 34),              # 5 local per global: layers 6, 12, 18, 24, 30 global
    (MISTRAL_7B, 4096, 32, 32),                  # Mistral-7B-v0.1: every layer
])
def test_the_layers_a_config_gives_the_window(cfg, window, sliding, layers):
    m = model_from_hf_config(cfg, "m")
    assert (m.sliding_window, m.num_sliding_window_layers, m.num_layers) == (window, sliding, layers)


def test_gpt_oss_alternates_a_128_token_window():
    m = MODEL_PRESETS["gpt-oss-120b"]
    assert (m.sliding_window, m.num_sliding_window_layers, m.num_layers) == (128, 18, 36)
    # a measured row of GPT-OSS keeps the preset's window (its record gives only the dimensions)
    row = {"name": "GPT-OSS 120B", "layers": 36, "hidden": 2880, "ffn_hidden": 2880, "heads": 64, "kv_heads": 8,
           "vocab": 201088, "num_experts": 128, "top_k": 4, "moe_ffn_hidden": 2880}
    assert model_from_row(row).num_sliding_window_layers == 18


def test_layer_types_in_the_config_win_over_the_family_pattern():
    types = ["sliding_attention"] * 3 + ["full_attention"]
    m = model_from_hf_config({**GEMMA2_9B, "num_hidden_layers": 4, "layer_types": types}, "g")
    assert m.num_sliding_window_layers == 3


@pytest.mark.parametrize("types", [["sliding_attention"] * 3, ["local"] * 4, "sliding_attention"])
def test_malformed_layer_types_name_the_key(types):
    with pytest.raises(SpecError, match="layer_types"):
        model_from_hf_config({**GEMMA2_9B, "num_hidden_layers": 4, "layer_types": types}, "g")


def test_a_window_layer_count_needs_a_window_and_fits_the_model():
    base = dict(name="m", num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                num_kv_heads=4, vocab_size=1000)
    with pytest.raises(SpecError, match="sliding_window_layers"):
        ModelSpec(**base, sliding_window=128, sliding_window_layers=5)
    with pytest.raises(SpecError, match="sliding_window_layers"):
        ModelSpec(**base, sliding_window_layers=2)
    assert ModelSpec(**base).num_sliding_window_layers == 0


def _computed_keys_per_query(s: int, w: int | None, block: int = 128) -> float:
    """Keys per query a tiled kernel computes: every block x block tile that holds one visible pair
    (key j visible to query i iff i - w <= j <= i; w None = causal) is computed whole."""
    q = np.arange(s)[:, None]
    k = np.arange(s)[None, :]
    visible = (k <= q) & ((q - k <= w) if w is not None else True)
    n = s // block
    tiles = visible.reshape(n, block, n, block).any(axis=(1, 3))
    return tiles.sum() * block * block / s


def _attention_s(tmp_path, window: int, seq: int = 4096, attn_eff_max: float = 0.4) -> float:
    cfg = {**MISTRAL_7B, "num_hidden_layers": 2, "max_position_embeddings": seq}
    if window:
        cfg["sliding_window"] = window
    else:
        cfg.pop("sliding_window")
    path = tmp_path / f"w{window}.json"
    path.write_text(json.dumps(cfg))
    problem = build_problem(model=str(path), gpu="h100", gpus=8, global_batch=8, seq_len=seq)

    def compute(eff):   # attn_seq_half ~ 0: the kernel's fixed cost per row out of the way
        params = EfficiencyParams(attn_eff_max=eff, attn_seq_half=1e-3)
        return predict_plan(problem, Plan(tp=1, pp=1, dp=8, mbs=1), params=params)["time_breakdown_s"]["compute"]
    # attention time alone: halving its rate doubles it and nothing else moves
    return compute(attn_eff_max / 2) - compute(attn_eff_max)


def test_a_window_saves_the_key_blocks_outside_it(tmp_path):
    seq, w = 4096, 128
    full, local = _attention_s(tmp_path, 0, seq), _attention_s(tmp_path, w, seq)
    saved = (full - local) / full              # share of the causal work the window removes
    brute = _computed_keys_per_query(seq, None) - _computed_keys_per_query(seq, w)
    # the model counts causal attention as s/2 keys per query
    assert saved * seq / 2 == pytest.approx(brute, rel=0.01)


def test_a_window_as_long_as_the_sequence_changes_nothing(tmp_path):
    assert _attention_s(tmp_path, 4096) == pytest.approx(_attention_s(tmp_path, 0), rel=1e-5)
    assert _attention_s(tmp_path, 8192) == pytest.approx(_attention_s(tmp_path, 0), rel=1e-5)


def test_the_cli_says_what_it_counts(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA2_9B))
    result = runner.invoke(app, ["predict", "--model", str(path), "--gpu", "h100", "--gpus", "8",
                                 "--global-batch", "16", "--seq-len", "8192", "--plan", "tp=8,recompute=full"])
    assert result.exit_code in (0, 3), result.stderr
    assert "sliding attention window of 4,096 tokens on 21 of 42 layers" in result.stdout


@settings(max_examples=60, deadline=None)
@given(seq=st.sampled_from([1024, 4096, 32768]), cp=st.sampled_from([1, 2, 8]),
       w1=st.integers(0, 40000), w2=st.integers(0, 40000), f1=st.floats(0, 1), f2=st.floats(0, 1),
       half=st.floats(0, 2048))
def test_a_longer_window_or_fewer_window_layers_never_costs_less(seq, cp, w1, w2, f1, f2, half):
    S, J, e = SimpleNamespace(cp=jnp.float32(cp)), {"seq_len": jnp.float32(seq), "packed_tokens": 0.0}, EfficiencyParams(attn_seq_half=half)

    def keys(w, f):
        return float(fused_attention_keys_per_query(S, {"window": jnp.float32(w), "window_layer_frac": jnp.float32(f)}, J, e))
    full = keys(0, 0)
    (wa, wb), (fa, fb) = sorted((w1, w2)), sorted((f1, f2))
    assert keys(wa, f1) <= keys(wb, f1) * (1 + 1e-6) <= full * (1 + 1e-5)
    assert keys(w1, fb) <= keys(w1, fa) * (1 + 1e-6)
    assert keys(w1, f1) >= FLASH_KEY_BLOCK / 2 * 0.999


def _bridge_gpt_oss_flops_per_token(seq: int, window: int = 128) -> float:
    """Megatron-Bridge's GPT-OSS model FLOPs (gpt_oss_flops_calculator: layers alternate full and
    sliding-window attention, the window's mask has w(w+1)/2 + (s-w)w visible pairs; top-4 of 128
    gated experts of 2880; the loss's 6 s h V), per token, written out from its formula."""
    layers, h, heads, groups, d, ffn, k, vocab = 36, 2880, 64, 8, 64, 2880, 4, 201088
    linear = seq * h * d * (heads + 2 * groups) + seq * h * d * heads
    full = heads * (seq * (seq + 1) / 2 * d) * 2
    swa = heads * ((window * (window + 1) / 2 + (seq - window) * window) * d) * 2
    moe = seq * k * h * ffn * 3
    total = sum(6 * (linear + (full if i % 2 == 0 else swa) + moe) for i in range(layers))
    return (total + 6 * seq * h * vocab) / seq


@pytest.mark.parametrize("seq", [4096, 32768])
def test_gpt_oss_model_flops_count_the_window_as_megatron_bridge_does(seq):
    problem = build_problem(model="gpt-oss-120b", gpu="h100", gpus=64, global_batch=64, seq_len=seq)
    rep = predict_plan(problem, Plan(tp=1, pp=1, dp=64, ep=8, mbs=1, recompute=Recompute.FULL))
    per_token = rep["model_tflops_per_gpu"] * 1e12 * rep["step_time_s"] * 64 / (64 * seq)
    # the router's 2 h E FLOPs per token and layer (0.3 %) are in this count, not in Bridge's
    assert per_token == pytest.approx(_bridge_gpt_oss_flops_per_token(seq), rel=5e-3)


def _export_args(cfg: dict, tmp_path) -> str:
    from autotune.export import export
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    problem = build_problem(model=str(path), gpu="h100", gpus=8, global_batch=8, seq_len=4096)
    return " ".join(t for t in export("megatron", Plan(tp=1, pp=1, dp=8, mbs=1), problem).text.split() if t != "\\")


def test_the_megatron_export_says_which_layers_use_the_window(tmp_path):
    # Megatron's TransformerLayer: a window on layer_number % k != 0 (1-based): Gemma-3's 5 local per global
    gemma3 = {**GEMMA3_4B, "text_config": {**GEMMA3_4B["text_config"], "num_hidden_layers": 12}}
    assert "--window-size 1024,0 --window-attn-skip-freq 6" in _export_args(gemma3, tmp_path)
    mistral = {**MISTRAL_7B, "num_hidden_layers": 2}
    args = _export_args(mistral, tmp_path)
    assert "--window-size 4096,0" in args and "--window-attn-skip-freq" not in args


def test_a_window_pattern_megatron_cannot_say_is_refused(tmp_path):
    from autotune.export import ExportRefused
    cfg = {**GEMMA2_9B, "num_hidden_layers": 4,
           "layer_types": ["sliding_attention"] + ["full_attention"] * 3}
    with pytest.raises(ExportRefused, match="sliding_window_layers"):
        _export_args(cfg, tmp_path)
