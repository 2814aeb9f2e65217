"""Model configs and GPU names a user brings (issue 13 "smaller things"): Gemma / Gemma-2 / Gemma-3
(nested `text_config`), Mistral's `sliding_window`, the h100-80gb alias, the listing commands.

Golden values are the parameter counts the model reports publish, not this code's output.
"""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from costmodels.presets import GPU_PRESETS, MODEL_PRESETS, load_gpu, model_from_hf_config

runner = CliRunner()

# google/gemma-2-9b config.json (the keys the model reads)
GEMMA2_9B = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
             "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
             "max_position_embeddings": 8192, "sliding_window": 4096}
# google/gemma-3-4b-it config.json: a multimodal config; the text model lists only the keys that
# differ from Gemma3TextConfig's defaults (8 heads, 4 KV heads, head_dim 256, vocabulary 262,208)
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                             "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},
             "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
# mistralai/Mistral-7B-v0.1 config.json
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000,
              "max_position_embeddings": 32768, "sliding_window": 4096, "tie_word_embeddings": False}


def test_gemma2_9b_parameter_count_matches_the_report():
    # Gemma 2 report (Gemma Team 2024, arXiv:2408.00118) Table 1, 9B: 8,324,201,984 non-embedding
    # parameters; embedding 917,962,752 is a 256,128-row table (the config's 256,000 + padding).
    m = model_from_hf_config(GEMMA2_9B, "gemma-2-9b")
    counts = m.param_counts()
    assert counts["total"] - counts["embedding"] == pytest.approx(8_324_201_984, rel=1e-4)
    assert counts["embedding"] == pytest.approx(917_962_752, rel=1e-3)
    assert m.tied_embeddings and m.gated_mlp and m.sliding_window == 4096


def test_gemma3_nested_text_config_with_defaults():
    # Gemma 3 report (Gemma Team 2025, arXiv:2503.19786) Table 1, 4B: 675M embedding and 3,209M
    # non-embedding parameters (the 417M vision encoder is not part of the language model)
    m = model_from_hf_config(GEMMA3_4B, "gemma-3-4b")
    counts = m.param_counts()
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_dim_eff) == (34, 2560, 8, 4, 256)
    assert counts["total"] - counts["embedding"] == pytest.approx(3_209e6, rel=2e-3)
    assert counts["embedding"] == pytest.approx(675e6, rel=1e-2)
    assert m.sliding_window == 1024 and m.tied_embeddings


def test_mistral_sliding_window_is_read_and_said(tmp_path):
    assert model_from_hf_config(MISTRAL_7B, "mistral-7b").sliding_window == 4096
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B))
    result = runner.invoke(app, ["predict", "--model", str(tmp_path), "--gpu", "h100-80gb", "--gpus", "8",
                                 "--global-batch", "16", "--seq-len", "8192", "--plan", "tp=8,recompute=full"])
    assert result.exit_code in (0, 3), result.stderr
    # Mistral 7B: 7.24 B parameters (Jiang et al. 2023, "Mistral 7B", model card: 7.3B)
    assert "7.2 B parameters" in result.stdout and "sliding attention window of 4,096" in result.stdout


def test_text_config_without_a_model_type_names_the_problem():
    with pytest.raises(ValueError, match="text_config"):
        model_from_hf_config({"model_type": "llava", "text_config": {"hidden_size": 8}}, "x")


def test_gpu_aliases_resolve_to_the_preset():
    assert load_gpu("h100-80gb") is GPU_PRESETS["h100"] and load_gpu("H100-SXM") is GPU_PRESETS["h100"]
    with pytest.raises(ValueError, match="h100"):
        load_gpu("h100-96gb")


@pytest.mark.parametrize("command, key, names", [
    ("models", "models", set(MODEL_PRESETS)),
    ("gpus", "gpus", set(GPU_PRESETS)),
])
def test_listing_commands_list_every_preset(command, key, names):
    result = runner.invoke(app, [command, "--json"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)[key]
    assert {r["name"] for r in rows} == names
    human = runner.invoke(app, [command])
    assert human.exit_code == 0 and all(n in human.stdout for n in names)


def test_listing_models_prints_published_parameter_counts():
    rows = {r["name"]: r for r in json.loads(runner.invoke(app, ["models", "--json"]).stdout)["models"]}
    # Llama 3 paper (Dubey et al. 2024) Table 3: 405B; Mixtral paper (Jiang et al. 2024): 47B total, 13B active
    assert rows["llama3.1-405b"]["parameters"] == pytest.approx(405e9, rel=0.01)
    assert rows["mixtral-8x7b"]["parameters"] == pytest.approx(46.7e9, rel=0.01)
    assert rows["mixtral-8x7b"]["active_parameters"] == pytest.approx(12.9e9, rel=0.01)


def test_listing_clusters_names_files_the_cluster_flag_accepts():
    rows = json.loads(runner.invoke(app, ["clusters", "--json"]).stdout)["clusters"]
    assert {"nvl72.yaml", "two-sites.yaml"} <= {r["file"] for r in rows}
    nvl72 = next(r for r in rows if r["file"] == "nvl72.yaml")
    assert nvl72["gpu"] == "gb200" and nvl72["nvlink_domain"] == 72


@pytest.mark.parametrize("cfg, key", [
    (dict(MISTRAL_7B, rope_scaling="yarn"), "rope_scaling"),          # was read as plain RoPE, silently
    (dict(MISTRAL_7B, rope_scaling=[1]), "rope_scaling"),
    ({"model_type": "gemma3", "text_config": []}, "text_config"),     # was "model_type 'gemma3' is not supported"
    ({"model_type": "gemma3", "text_config": "x"}, "text_config"),
])
def test_malformed_nested_keys_are_named(cfg, key, tmp_path):
    with pytest.raises(ValueError, match=key):
        model_from_hf_config(cfg, "x")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = runner.invoke(app, ["predict", "--model", str(tmp_path), "--gpu", "h100", "--gpus", "8",
                                 "--global-batch", "16", "--seq-len", "4096", "--plan", "tp=8"])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1 and key in result.stderr, result.stderr
