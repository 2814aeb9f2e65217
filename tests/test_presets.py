"""Presets and readers: GPU and model presets, Hugging Face config.json, cluster files."""
from __future__ import annotations

import json

import pytest

from costmodels.presets import (
    CLUSTER_DIR, GPU_PRESETS, MODEL_PRESETS, SUPPORTED_MODEL_TYPES, build_cluster, load_gpu,
    load_model, model_from_hf_config, resolve_cluster_file, shipped_cluster_files,
)
from costmodels.specs import ClusterSpec, GPUSpec, ModelSpec, Precision, SpecError

B = 1e9

# ---------------------------------------------------------------------------------------------
# GPU presets
# ---------------------------------------------------------------------------------------------

GPU_KEYS = ["a100-40gb", "a100-80gb", "h100", "h200", "h800", "b200", "b300", "gb200", "gb300", "mi300x"]
FP4_GPUS = {"b200", "b300", "gb200", "gb300"}


def test_gpu_preset_keys():
    assert list(GPU_PRESETS) == GPU_KEYS


@pytest.mark.parametrize("name", GPU_KEYS)
def test_gpu_preset_is_sane(name):
    g = GPU_PRESETS[name]
    assert isinstance(g, GPUSpec) and g.name == name and g.source and g.family
    assert g.family in {"ampere", "hopper", "blackwell", "cdna3"}
    assert 100e12 < g.peak_flops_bf16 < 5e15                 # dense, FLOP/s
    assert (g.peak_flops_fp8 == 0) == (g.family == "ampere")
    assert g.peak_flops_fp8 in (0, pytest.approx(2 * g.peak_flops_bf16, rel=1e-3))
    assert (g.peak_flops_fp4 > 0) == (name in FP4_GPUS)
    assert 40 * 2**30 <= g.hbm_bytes <= 288 * 2**30 and 1e12 < g.hbm_bandwidth_bytes_per_s < 10e12
    assert g.intra_node_bw_bytes_per_s >= 4 * g.inter_node_bw_bytes_per_s
    assert g.gpus_per_node == (72 if name.startswith("gb") else 8)
    assert g.peak_flops(Precision.FP8) == g.peak_flops_fp8


@pytest.mark.parametrize("name, bf16_tflops, hbm_gb, hbm_tbps, nvlink_gbps, nic_gbps", [
    ("a100-40gb", 312, 40, 1.555, 300, 25),
    ("a100-80gb", 312, 80, 2.039, 300, 25),
    ("h100", 989.4, 80, 3.35, 450, 50),
    ("h200", 989.4, 141, 4.8, 450, 50),
    ("h800", 989.4, 80, 3.35, 200, 50),
    ("b200", 2250, 180, 7.7, 900, 50),
    ("b300", 2250, 288, 8, 900, 100),
    ("gb200", 2500, 186, 8, 900, 50),
    ("gb300", 2500, 288, 8, 900, 100),
    ("mi300x", 1307.4, 192, 5.3, 448, 50),
])
def test_gpu_datasheet_figures_in_si(name, bf16_tflops, hbm_gb, hbm_tbps, nvlink_gbps, nic_gbps):
    g = load_gpu(name)
    assert g.peak_flops_bf16 == pytest.approx(bf16_tflops * 1e12)
    assert g.hbm_bytes == pytest.approx(hbm_gb * 2**30)      # printed GB are binary (GiB)
    assert g.hbm_bandwidth_bytes_per_s == pytest.approx(hbm_tbps * 1e12)
    assert g.intra_node_bw_bytes_per_s == pytest.approx(nvlink_gbps * 1e9)
    assert g.inter_node_bw_bytes_per_s == pytest.approx(nic_gbps * 1e9)


def test_load_gpu_is_case_insensitive_and_unknown_lists_known():
    assert load_gpu(" H100 ") is GPU_PRESETS["h100"]
    with pytest.raises(SpecError) as e:
        load_gpu("v100")
    assert e.value.field == "gpu" and "'v100'" in str(e.value) and "h100" in str(e.value)


# ---------------------------------------------------------------------------------------------
# Model presets and parameter counts
# ---------------------------------------------------------------------------------------------

REQUIRED_MODELS = ["gpt3-175b", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b",
                   "llama3.1-405b", "mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b",
                   "qwen3-235b-a22b", "deepseek-v2-lite", "deepseek-v3", "gpt-oss-120b"]


def test_model_presets_present():
    assert set(REQUIRED_MODELS) <= set(MODEL_PRESETS)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_model_preset_constructs(name):
    m = MODEL_PRESETS[name]
    assert isinstance(m, ModelSpec) and m.name == name and m.source
    assert load_model(name.upper()) is m
    counts = m.param_counts()
    assert 0 < counts["active"] <= counts["total"]
    assert m.is_moe == (counts["active"] < counts["total"])


def _input_embedding(name):
    m = MODEL_PRESETS[name]
    return m.vocab_size * m.hidden_size


# (preset, published total, published active or None, relative tolerance). 1% where the figure
# has three or more significant digits; 2% where it is rounded to two.
# DeepSeek and OpenAI count active parameters without the input embedding (a lookup, no FLOPs);
# ModelSpec.param_counts() includes it, so it is added back to their published figures.
PUBLISHED = [
    ("gpt3-175b", 175e9, None, 0.01),              # Brown et al. 2020, Table 2.1
    ("llama2-7b", 6.74e9, None, 0.01),
    ("llama3-70b", 70.6e9, None, 0.01),
    ("llama3.1-405b", 405.8e9, None, 0.01),
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),        # Jiang et al. 2024
    ("mixtral-8x22b", 141e9, 39e9, 0.01),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02),
    ("qwen3-235b-a22b", 235e9, 22e9, 0.01),
    # README_WEIGHTS.md: main model 671B, 36.6B active incl. the 0.9B output head (MTP excluded)
    ("deepseek-v3", 671e9, 36.6e9 + _input_embedding("deepseek-v3"), 0.01),
    ("deepseek-v2-lite", 15.7e9, 2.4e9 + _input_embedding("deepseek-v2-lite"), 0.02),
    ("gpt-oss-120b", 116.8e9, 5.13e9 + _input_embedding("gpt-oss-120b"), 0.01),   # model card
]


@pytest.mark.parametrize("name, total, active, rel", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_param_counts_match_published(name, total, active, rel):
    counts = MODEL_PRESETS[name].param_counts()
    assert counts["total"] == pytest.approx(total, rel=rel)
    if active is not None:
        assert counts["active"] == pytest.approx(active, rel=rel)


def test_deepseek_v3_active_as_commonly_quoted():
    # The headline "37B activated" (DeepSeek-V3 report) within 2% including the input embedding.
    assert MODEL_PRESETS["deepseek-v3"].param_counts()["active"] == pytest.approx(37e9, rel=0.02)


def test_moe_layout_of_presets():
    v3 = MODEL_PRESETS["deepseek-v3"]
    assert (v3.first_k_dense_layers, v3.num_moe_layers, v3.num_kv_heads, v3.is_mla) == (3, 58, 128, True)
    lite = MODEL_PRESETS["deepseek-v2-lite"]
    assert (lite.q_lora_rank, lite.num_shared_experts, lite.num_moe_layers) == (0, 2, 26)
    q = MODEL_PRESETS["qwen3-30b-a3b"]
    assert (q.head_dim_eff, q.num_kv_heads, q.num_moe_layers, q.num_shared_experts) == (128, 4, 48, 0)
    gpt3 = MODEL_PRESETS["gpt3-175b"]
    assert (gpt3.ffn_hidden_size, gpt3.gated_mlp, gpt3.tied_embeddings, gpt3.max_seq_len) == \
        (49152, False, True, 2048)


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json round trips (small hand-written configs)
# ---------------------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}

HF_CASES = {
    "gpt2": ({"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "n_inner": None,
              "n_positions": 512, "vocab_size": 50257},
             dict(num_layers=2, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
                  num_kv_heads=4, vocab_size=50257, max_seq_len=512, gated_mlp=False,
                  tied_embeddings=True, num_experts=0)),
    "llama": (LLAMA,
              dict(num_layers=4, hidden_size=256, ffn_hidden_size=688, num_attention_heads=8,
                   num_kv_heads=2, vocab_size=1000, max_seq_len=2048, gated_mlp=True,
                   tied_embeddings=False, head_dim=None)),
    "mistral": ({"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 256,
                 "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "head_dim": 64, "vocab_size": 32768, "max_position_embeddings": 32768},
                dict(num_kv_heads=4, head_dim=64, head_dim_eff=64, tied_embeddings=False,
                     max_seq_len=32768)),
    "gemma": ({"model_type": "gemma", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512,
               "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 1000},
              dict(tied_embeddings=True, gated_mlp=True, head_dim_eff=64, sliding_window=0)),
    "gemma2": ({"model_type": "gemma2", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
                "sliding_window": 4096},
               dict(tied_embeddings=True, sliding_window=4096, num_kv_heads=2)),
    "gemma3_text": ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 2,
                                                             "hidden_size": 128, "intermediate_size": 256}},
                    dict(num_layers=2, num_attention_heads=8, num_kv_heads=4, head_dim_eff=256, vocab_size=262208,
                         sliding_window=4096, tied_embeddings=True)),
    "qwen2": ({"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 128,
               "intermediate_size": 256, "num_attention_heads": 4, "vocab_size": 151936,
               "tie_word_embeddings": True},        # no num_key_value_heads: MHA
              dict(num_kv_heads=4, tied_embeddings=True, gated_mlp=True, max_seq_len=4096)),
    "mixtral": ({"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 128,
                 "intermediate_size": 448, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000},
                dict(num_experts=8, experts_per_token=2, moe_ffn_hidden_size=448,
                     first_k_dense_layers=0, moe_layer_freq=1, num_moe_layers=2)),
    "qwen2_moe": ({"model_type": "qwen2_moe", "num_hidden_layers": 4, "hidden_size": 128,
                   "intermediate_size": 512, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 256, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "num_experts": 60, "num_experts_per_tok": 4,
                   "decoder_sparse_step": 1, "mlp_only_layers": [0], "vocab_size": 1000},
                  dict(num_experts=60, moe_ffn_hidden_size=64, num_shared_experts=1,
                       shared_expert_ffn_hidden_size=256, first_k_dense_layers=1, num_moe_layers=3)),
    "qwen3_moe": ({"model_type": "qwen3_moe", "num_hidden_layers": 6, "hidden_size": 128,
                   "intermediate_size": 384, "moe_intermediate_size": 32, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16,
                   "num_experts_per_tok": 4, "decoder_sparse_step": 2, "mlp_only_layers": [],
                   "vocab_size": 1000},
                  # (i + 1) % 2 == 0: layers 1, 3, 5 are MoE
                  dict(head_dim=32, num_shared_experts=0, first_k_dense_layers=1, moe_layer_freq=2,
                       num_moe_layers=3, ffn_hidden_size=384)),
    "deepseek_v3": ({"model_type": "deepseek_v3", "num_hidden_layers": 5, "hidden_size": 256,
                     "intermediate_size": 512, "moe_intermediate_size": 64, "num_attention_heads": 8,
                     "num_key_value_heads": 8, "n_routed_experts": 16, "n_shared_experts": 1,
                     "num_experts_per_tok": 4, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                     "q_lora_rank": 96, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
                     "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 1000,
                     "max_position_embeddings": 4096},
                    dict(num_kv_heads=8, num_experts=16, num_shared_experts=1, first_k_dense_layers=1,
                         num_moe_layers=4, q_lora_rank=96, kv_lora_rank=32, is_mla=True)),
    "deepseek_v2": ({"model_type": "deepseek_v2", "num_hidden_layers": 6, "hidden_size": 128,
                     "intermediate_size": 256, "moe_intermediate_size": 32, "num_attention_heads": 4,
                     "num_key_value_heads": 1, "n_routed_experts": 8, "n_shared_experts": 2,
                     "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 2,
                     "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                     "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 1000},
                    # i >= 1 and i % 2 == 0: layers 2 and 4 are MoE
                    dict(num_kv_heads=4, q_lora_rank=0, first_k_dense_layers=2, moe_layer_freq=2,
                         num_moe_layers=2)),
    "gpt_oss": ({"model_type": "gpt_oss", "num_hidden_layers": 2, "hidden_size": 128,
                 "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 64, "num_local_experts": 8, "experts_per_token": 2, "vocab_size": 1000},
                dict(head_dim=64, num_experts=8, experts_per_token=2, moe_ffn_hidden_size=128)),
}


def test_every_supported_model_type_has_a_round_trip_case():
    assert set(HF_CASES) | {"qwen3"} == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(HF_CASES))
def test_hf_config_round_trip(model_type, tmp_path):
    cfg, expected = HF_CASES[model_type]
    from_dict = model_from_hf_config(cfg, "tiny")
    for attr, value in expected.items():
        assert getattr(from_dict, attr) == value, attr
    folder = tmp_path / "tiny-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    for arg in (str(folder / "config.json"), str(folder)):
        from_file = load_model(arg)
        assert from_file.name == "tiny-model" and from_file.source == str(folder / "config.json")
        assert from_file.param_counts() == from_dict.param_counts()


def test_hf_mixtral_param_counts_by_hand():
    m = model_from_hf_config(HF_CASES["mixtral"][0], "tiny")
    h, f, V, L, E = 128, 448, 32000, 2, 8
    attn = h * (4 + 2 * 2) * 32 + 4 * 32 * h
    expected_total = 2 * V * h + L * (attn + E * 3 * h * f + h * E + 2 * h) + h
    assert m.param_counts()["total"] == expected_total


def test_preset_config_and_user_config_agree(tmp_path):
    # A user's copy of a published config.json gives the same spec as the preset.
    cfg = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
           "max_position_embeddings": 32768, "tie_word_embeddings": False, "rope_theta": 1e6,
           "architectures": ["MixtralForCausalLM"], "head_dim": None}
    assert model_from_hf_config(cfg, "x").param_counts() == MODEL_PRESETS["mixtral-8x7b"].param_counts()


def test_deepseek_without_routed_experts_is_dense():
    cfg = dict(HF_CASES["deepseek_v3"][0], n_routed_experts=None)
    m = model_from_hf_config(cfg, "dense")
    assert not m.is_moe and m.first_k_dense_layers == 0


# ---------------------------------------------------------------------------------------------
# Model errors: one SpecError naming the field, no traceback material
# ---------------------------------------------------------------------------------------------

def _error(fn, *args, **kwargs) -> SpecError:
    with pytest.raises(SpecError) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return e.value


def test_unknown_model_preset_lists_known():
    e = _error(load_model, "llama5-1t")
    assert e.field == "model"
    assert str(e).startswith("model: unknown preset 'llama5-1t'; known presets: gpt3-175b, ")
    assert "deepseek-v3" in str(e)


def test_missing_key_is_named():
    cfg = {k: v for k, v in LLAMA.items() if k != "hidden_size"}
    e = _error(model_from_hf_config, cfg, "x")
    assert e.field == "model"
    assert e.reason == "config.json (model_type llama) is missing key 'hidden_size'"


@pytest.mark.parametrize("model_type, key", [
    ("gpt2", "n_embd"), ("mixtral", "num_local_experts"), ("qwen3_moe", "moe_intermediate_size"),
    ("deepseek_v3", "kv_lora_rank"),
])
def test_missing_family_key_is_named(model_type, key):
    cfg = {k: v for k, v in HF_CASES[model_type][0].items() if k != key}
    assert f"is missing key '{key}'" in _error(model_from_hf_config, cfg, "x").reason


def test_unsupported_model_type_lists_supported():
    e = _error(model_from_hf_config, dict(LLAMA, model_type="mamba"), "x")
    assert "'mamba'" in e.reason and "llama" in e.reason and "deepseek_v3" in e.reason
    e = _error(model_from_hf_config, {k: v for k, v in LLAMA.items() if k != "model_type"}, "x")
    assert "has no 'model_type'" in e.reason


@pytest.mark.parametrize("key, value", [
    ("hidden_size", "256"), ("num_hidden_layers", 4.0), ("tie_word_embeddings", "false"),
    ("num_key_value_heads", True),
])
def test_wrong_value_types_are_named(key, value):
    e = _error(model_from_hf_config, dict(LLAMA, **{key: value}), "x")
    assert e.field == "model" and f"'{key}'" in e.reason


def test_spec_rules_still_apply_to_hf_configs():
    e = _error(model_from_hf_config, dict(LLAMA, num_key_value_heads=3), "x")
    assert e.field == "num_kv_heads"


@pytest.mark.parametrize("changes, words", [
    ({"mlp_only_layers": [1]}, "MoE layers [0, 2, 3]"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be >= 1"),
    ({"mlp_only_layers": "0"}, "'mlp_only_layers' must be a list of integers"),
])
def test_unrepresentable_or_bad_moe_layouts(changes, words):
    cfg = dict(HF_CASES["qwen2_moe"][0], **changes)
    assert words in _error(model_from_hf_config, cfg, "x").reason


def test_model_file_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    e = _error(load_model, str(missing))
    assert e.field == "model" and str(missing) in e.reason and "No such file" in e.reason

    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama",')
    e = _error(load_model, str(bad))
    assert str(bad) in e.reason and "not valid JSON" in e.reason and "line 1" in e.reason

    bad.write_text("[1, 2]")
    assert "mapping" in _error(load_model, str(bad)).reason

    bad.write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "vocab_size"}))
    assert _error(load_model, str(bad)).reason == \
        f"{bad} (model_type llama) is missing key 'vocab_size'"


# ---------------------------------------------------------------------------------------------
# Clusters
# ---------------------------------------------------------------------------------------------

def test_shipped_cluster_files_and_readme():
    assert shipped_cluster_files() == ["dgx-h100-superpod.yaml", "nvl72.yaml", "two-sites.yaml"]
    readme = (CLUSTER_DIR / "README.md").read_text()
    for name in ("name", "gpu", "gpus", "nvlink_domain_size", "gpus_per_node",
                 "intra_node_bandwidth_gb_per_s", "inter_node_bandwidth_gb_per_s", "fabric_bandwidth_factor",
                 "intra_node_latency_us", "inter_node_latency_us", "host_op_x", "sites", "count",
                 "gpus_per_site", "wan_bandwidth_gb_per_s", "wan_latency_ms"):
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("arg", ["nvl72.yaml", "nvl72", str(CLUSTER_DIR / "nvl72.yaml")])
def test_resolve_cluster_file(arg):
    assert resolve_cluster_file(arg) == CLUSTER_DIR / "nvl72.yaml"


def test_resolve_unknown_cluster_file_lists_shipped():
    e = _error(resolve_cluster_file, "nvl36.yaml")
    assert e.field == "cluster_file" and "nvl72.yaml" in e.reason and "two-sites.yaml" in e.reason


def test_nvl72_file():
    c = build_cluster(cluster_file="nvl72.yaml")
    assert isinstance(c, ClusterSpec)
    assert (c.gpu.name, c.num_gpus, c.nvlink_domain_size, c.num_sites) == ("gb200", 4608, 72, 1)
    assert c.intra_node_bw_bytes_per_s == 900 * B and c.inter_node_bw_bytes_per_s == 50 * B


def test_dgx_superpod_file():
    c = build_cluster(cluster_file="dgx-h100-superpod.yaml")
    assert (c.gpu.name, c.num_gpus, c.nvlink_domain_size, c.fabric_bw_factor) == ("h100", 1024, 8, 1.0)
    assert c.inter_node_bw_bytes_per_s == 50 * B


def test_two_sites_file_wan_is_100x_slower_per_gpu():
    c = build_cluster(cluster_file="two-sites.yaml")
    assert (c.num_sites, c.gpus_per_site, c.wan_latency_s) == (2, 512, pytest.approx(0.010))
    wan_share_per_gpu = c.wan_bw_bytes_per_s / c.gpus_per_site
    assert c.inter_node_bw_bytes_per_s * c.fabric_bw_factor / wan_share_per_gpu == pytest.approx(100)


def test_preset_only_cluster_uses_gpu_defaults():
    c = build_cluster(gpu="h100", num_gpus=64)
    g = GPU_PRESETS["h100"]
    assert (c.num_gpus, c.nvlink_domain_size, c.num_sites, c.fabric_bw_factor) == (64, 8, 1, 1.0)
    assert c.intra_node_bw_bytes_per_s == g.intra_node_bw_bytes_per_s
    assert c.inter_node_bw_bytes_per_s == g.inter_node_bw_bytes_per_s
    assert c.name == "64 x h100"


def test_partial_node_is_fine():
    c = build_cluster(gpu="gb200", num_gpus=4)
    assert (c.num_gpus, c.nvlink_domain_size) == (4, 4)


def test_cli_overrides_file_overrides_preset(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("gpu: a100-80gb\ngpus: 128\ninter_node_bandwidth_gb_per_s: 12.5\n"
                 "intra_node_bandwidth_gb_per_s: 250\nfabric_bandwidth_factor: 0.5\n"
                 "inter_node_latency_us: 10\n")
    c = build_cluster(cluster_file=str(f))
    assert (c.gpu.name, c.num_gpus, c.fabric_bw_factor) == ("a100-80gb", 128, 0.5)
    assert c.inter_node_bw_bytes_per_s == 12.5 * B and c.intra_node_bw_bytes_per_s == 250 * B
    assert c.inter_node_latency_s == pytest.approx(10e-6) and c.intra_node_latency_s == 3e-6
    c = build_cluster(gpu="h100", num_gpus=256, gpus_per_node=4, inter_node_bw_gbps=25,
                      cluster_file=str(f))
    assert (c.gpu.name, c.num_gpus, c.nvlink_domain_size) == ("h100", 256, 4)
    assert c.inter_node_bw_bytes_per_s == 25 * B and c.intra_node_bw_bytes_per_s == 250 * B


def test_json_cluster_file_and_gpus_from_sites(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"gpu": "h100", "sites": {"count": 4, "gpus_per_site": 64,
                                                      "wan_bandwidth_gb_per_s": 100, "wan_latency_ms": 5}}))
    c = build_cluster(cluster_file=str(f))
    assert (c.num_gpus, c.num_sites, c.wan_bw_bytes_per_s) == (256, 4, 100 * B)


def _write(tmp_path, text, name="c.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return str(f)


SITES = "sites: {count: 2, gpus_per_site: 256, wan_bandwidth_gb_per_s: 100, wan_latency_ms: 10}\n"

BAD_CLUSTERS = [
    # (file text, CLI kwargs, field, words in the reason)
    ("gpu: h100\ngpus: 1024\n" + SITES, {}, "cluster.sites.gpus_per_site",
     "2 sites x 256 GPUs = 512, but gpus = 1024"),
    ("gpu: h100\n" + SITES, {"num_gpus": 1024}, "cluster.sites.gpus_per_site", "= 512, but gpus = 1024"),
    ("gpu: h100\ngpus: 1001\n", {}, "cluster.gpus", "not a multiple of the NVLink domain size 8"),
    ("gpu: h100\ngpus: 100\nsites: {count: 2, wan_bandwidth_gb_per_s: 1, wan_latency_ms: 1}\n", {},
     "cluster.sites.gpus_per_site", "50 GPUs per site is not a multiple"),
    ("gpu: h100\ngpus: 1001\nsites: {count: 2, wan_bandwidth_gb_per_s: 1, wan_latency_ms: 1}\n", {},
     "cluster.sites.count", "does not split evenly over 2 sites"),
    ("gpu: h100\ngpus: 64\nsites: {count: 2, wan_latency_ms: 10}\n", {},
     "cluster.sites.wan_bandwidth_gb_per_s", "positive number"),
    ("gpu: h100\ngpus: 64\nsites: {count: 2, wan_bandwidth_gb_per_s: 10}\n", {},
     "cluster.sites.wan_latency_ms", "positive number"),
    ("gpu: h100\ngpus: 64\nsites: {gpus_per_site: 32}\n", {}, "cluster.sites.count", "positive integer"),
    ("gpu: h100\ngpus: 64\nsites: 2\n", {}, "cluster.sites", "must be a mapping"),
    ("gpu: h100\ngpus: 64\nsites: {count: 1, wan_bw: 3}\n", {}, "cluster.sites.wan_bw", "unknown field"),
    ("gpu: h100\ngpus: 64\ninter_node_bandwith_gbps: 50\n", {}, "cluster.inter_node_bandwith_gbps",
     "unknown field; known fields: name, gpu, gpus"),
    ("gpu: h100\ngpus: 64.0\n", {}, "cluster.gpus", "positive integer"),
    ("gpu: h100\ngpus: 64\n", {"num_gpus": 0}, "gpus", "positive integer"),
    ("gpu: h100\ngpus: 64\n", {"num_gpus": True}, "gpus", "positive integer"),
    ("gpu: h100\n", {}, "gpus", "give the number of GPUs"),
    ("gpus: 64\n", {}, "gpu", "give a GPU preset"),
    ("gpu: v100\ngpus: 64\n", {}, "cluster.gpu", "unknown GPU preset 'v100'"),
    ("gpu: h100\ngpus: 64\n", {"gpu": "tpu"}, "gpu", "unknown GPU preset 'tpu'"),
    ("gpu: h100\ngpus: 64\nfabric_bandwidth_factor: 2\n", {}, "cluster.fabric_bandwidth_factor",
     "must be in (0, 1]"),
    ("gpu: h100\ngpus: 64\nfabric_bandwidth_factor: 0\n", {}, "cluster.fabric_bandwidth_factor",
     "positive number"),
    ("gpu: h100\ngpus: 64\nhost_op_x: 0\n", {}, "cluster.host_op_x", "positive number"),
    ("gpu: h100\ngpus: 64\nhost_op_x: 40\n", {}, "cluster.host_op_x", "in [0.1, 10]"),
    ("gpu: h100\ngpus: 64\nhost_op_x: grace\n", {}, "cluster.host_op_x", "positive number"),
    ("gpu: h100\ngpus: 64\ninter_node_bandwidth_gb_per_s: fast\n", {}, "cluster.inter_node_bandwidth_gb_per_s",
     "positive number"),
    ("gpu: h100\ngpus: 64\n", {"intra_node_bw_gbps": -1}, "intra_node_bw_gbps", "positive number"),
    ("gpu: h100\ngpus: 64\ngpus_per_node: 8\nnvlink_domain_size: 4\n", {},
     "cluster.nvlink_domain_size", "differs from gpus_per_node=8"),
    ("gpu: h100\ngpus: 64\n", {"gpus_per_node": 0}, "gpus_per_node", "positive integer"),
    ("gpu: h100\ngpus: [64\n", {}, "cluster_file", "is not valid YAML"),
    ("- gpu: h100\n", {}, "cluster_file", "must hold a mapping"),
    ("", {}, "cluster_file", "must hold a mapping"),
]


@pytest.mark.parametrize("text, kwargs, field, words", BAD_CLUSTERS,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_CLUSTERS)])
def test_bad_cluster_inputs_name_the_field(tmp_path, text, kwargs, field, words):
    e = _error(build_cluster, cluster_file=_write(tmp_path, text), **kwargs)
    assert e.field == field
    assert words in e.reason


def test_bad_json_cluster_file(tmp_path):
    e = _error(build_cluster, cluster_file=_write(tmp_path, '{"gpu": "h100",}', "c.json"))
    assert e.field == "cluster_file" and "not valid JSON" in e.reason and "line 1" in e.reason


def test_missing_cluster_file(tmp_path):
    e = _error(build_cluster, gpu="h100", num_gpus=8, cluster_file=str(tmp_path / "missing.yaml"))
    assert e.field == "cluster_file" and "missing.yaml" in e.reason


def test_cli_only_errors():
    assert _error(build_cluster, gpu="h100", num_gpus=12).field == "gpus"
    assert _error(build_cluster, gpu="h100", num_gpus=-8).field == "gpus"
    assert _error(build_cluster, gpu="h100", num_gpus=None).field == "gpus"
    assert _error(build_cluster, gpu=None, num_gpus=8).field == "gpu"


@pytest.mark.parametrize("gpu, gpus, domain", [("gb200", 256, 64), ("gb300", 100, 50), ("gb200", 144, 72)])
def test_rack_scale_jobs_take_an_equal_share_of_each_rack(gpu, gpus, domain):
    assert build_cluster(gpu=gpu, num_gpus=gpus).nvlink_domain_size == domain


def test_cluster_files_read_old_gbps_names_as_gb_per_s(tmp_path):
    """*_gbps was the old spelling of *_gb_per_s (GB/s): read the same; both at once are refused."""
    from costmodels.presets import build_cluster
    from costmodels.specs import SpecError
    old = tmp_path / "old.yaml"
    old.write_text("gpu: h100\ngpus: 16\ninter_node_bandwidth_gbps: 25\n")
    new = tmp_path / "new.yaml"
    new.write_text("gpu: h100\ngpus: 16\ninter_node_bandwidth_gb_per_s: 25\n")
    assert build_cluster(cluster_file=str(old)).inter_node_bw_bytes_per_s == 25e9
    assert build_cluster(cluster_file=str(new)).inter_node_bw_bytes_per_s == 25e9
    both = tmp_path / "both.yaml"
    both.write_text("gpu: h100\ngpus: 16\ninter_node_bandwidth_gbps: 25\ninter_node_bandwidth_gb_per_s: 25\n")
    with pytest.raises(SpecError, match="inter_node_bandwidth_gbps"):
        build_cluster(cluster_file=str(both))


# Maximum achievable matmul TFLOP/s / dense peak, as measured with mamf-finder.py and published in
# ml-engineering's "Maximum Achievable Matmul FLOPS comparison table" (bf16 A100 SXM 267.9 of 312,
# H100 SXM 794.5 of 989, B200 1745 of 2250, MI300X 781.9 of 1300; fp8 H200 1453.4 of 1979, B200
# 3432.5 of 4500)
@pytest.mark.parametrize("name, prec, mamf_tflops, peak_tflops", [
    ("a100-80gb", Precision.BF16, 267.9, 312), ("h100", Precision.BF16, 794.5, 989),
    ("b200", Precision.BF16, 1745.0, 2250), ("mi300x", Precision.BF16, 781.9, 1300),
    ("h200", Precision.FP8, 1453.4, 1979), ("b200", Precision.FP8, 3432.5, 4500)])
def test_gpu_matmul_fraction_is_the_published_mamf(name, prec, mamf_tflops, peak_tflops):
    assert GPU_PRESETS[name].matmul_frac(prec) == pytest.approx(mamf_tflops / peak_tflops, abs=1.5e-3)


def test_a_higher_achievable_matmul_rate_is_never_slower():
    import dataclasses

    from autotune import api
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=16, global_batch=64, seq_len=4096)
    plan = api.plan_from_text("tp=2,pp=2,mbs=1", problem)
    times = []
    for frac in (0.5, 0.7, 0.9, 1.0):
        gpu = dataclasses.replace(problem.cluster.gpu, matmul_frac_bf16=frac)
        p = dataclasses.replace(problem, cluster=dataclasses.replace(problem.cluster, gpu=gpu))
        times.append(api.predict_plan(p, plan)["step_time_s"])
    assert all(a > b for a, b in zip(times, times[1:]))


def test_matmul_fraction_out_of_range_is_refused():
    with pytest.raises(SpecError, match="matmul_frac_bf16"):
        dataclasses_replace_gpu(matmul_frac_bf16=1.3)


def dataclasses_replace_gpu(**kw):
    import dataclasses
    return dataclasses.replace(GPU_PRESETS["h100"], **kw)
