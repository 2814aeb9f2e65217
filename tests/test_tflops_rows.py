"""Runs that publish only a model TFLOP/s figure: `validate` compares them on it, in the FLOPs count of their source.

Golden values: NeMo's Llama-2 FLOPs formula (nemo/utils/flops_formulas.py `llama2`, before its causal_self_attn
factor: L h^2 (12 + 12 g/a + 18 f/h + 12 s/h) + 6 h V per token, every attention score counted) and Megatron-LM's
num_floating_point_operations since 8873b55d6a (2025-03-06: the s/h term halved for the causal mask). Neither is
this project's code: a derived throughput that matches them proves the conversion, and the cost model's own FLOPs.
"""
from __future__ import annotations

import copy
import json

import pytest

from autotune.validate import attention_flops_count, validate_rows
from cli.main import app
from typer.testing import CliRunner

LLAMA2_7B = {"name": "Llama 2 7B", "layers": 32, "hidden": 4096, "ffn_hidden": 11008, "heads": 32, "kv_heads": 32,
             "vocab": 32000, "seq_len": 4096, "num_experts": None, "top_k": None, "moe_ffn_hidden": None}


def _row(seq_len: int = 4096, tflops: float = 600.0, **extra) -> dict:
    return {"id": f"llama2-7b-{seq_len}", "usable": True, "source": {"title": "a vendor page", "group": "vendor"},
            "model": {**LLAMA2_7B, "seq_len": seq_len},
            "hardware": {"gpu": "H100", "gpu_key": "h100", "num_gpus": 8, "gpus_per_node": 8},
            "plan": {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": None, "vpp": None, "micro_batch": 1,
                     "global_batch": 64, "sequence_parallel": None, "recompute_key": "full", "zero_key": 1,
                     "precision_key": "bf16"},
            "measured": {"tflops_per_gpu": tflops, "tokens_per_s_per_gpu": None, "iteration_time_s": None,
                         **({"extra": extra} if extra else {})}}


def nemo_llama2_flops_per_token(s: int, causal: bool) -> float:
    m = LLAMA2_7B
    L, h, f, a, g, V = m["layers"], m["hidden"], m["ffn_hidden"], m["heads"], m["kv_heads"], m["vocab"]
    return L * h * h * (12 + 12 * g / a + 18 * f / h + 12 * s / h * (0.5 if causal else 1.0) + 6 * V / (L * h))


def _only(result: dict) -> dict:
    (run,) = result["runs"]
    return run


@pytest.mark.parametrize("seq_len", [4096, 32768])
@pytest.mark.parametrize("count", ["full", "causal"])
def test_tflops_only_run_is_compared_in_its_sources_flops_count(seq_len, count):
    run = _only(validate_rows([_row(seq_len, 600.0, attention_flops=count)]))
    golden = 600e12 / nemo_llama2_flops_per_token(seq_len, causal=count == "causal")
    assert run["skipped"] is None
    assert run["measured_tokens_per_s_per_gpu"] == pytest.approx(golden, rel=2e-3)
    assert run["compared_on"] == f"model TFLOP/s (attention counted {count})"
    assert run["error_pct"] == pytest.approx(100 * (run["predicted_tokens_per_s_per_gpu"] / golden - 1), rel=1e-3)


def test_counting_every_score_means_fewer_tokens_for_the_same_figure():
    full = _only(validate_rows([_row(65536, attention_flops="full")]))
    causal = _only(validate_rows([_row(65536, attention_flops="causal")]))
    assert full["predicted_tokens_per_s_per_gpu"] == causal["predicted_tokens_per_s_per_gpu"]
    assert full["measured_tokens_per_s_per_gpu"] < 0.8 * causal["measured_tokens_per_s_per_gpu"]


def test_source_rule_reads_megatron_recipes_as_causal_and_the_rest_as_full():
    row = _row()
    assert attention_flops_count(row) == "full"
    row["source"]["group"] = "Megatron-LM moe_recipes index"
    assert attention_flops_count(row) == "causal"


def test_tokens_per_s_wins_over_tflops_and_tflops_runs_are_summed_up_apart():
    both = _row(tflops=600.0)
    both["id"] = "both"
    both["measured"]["tokens_per_s_per_gpu"] = 2000.0
    out = validate_rows([both, _row(tflops=600.0)])
    by_id = {r["id"]: r for r in out["runs"]}
    assert by_id["both"]["compared_on"] == "tokens/s"
    assert by_id["both"]["measured_tokens_per_s_per_gpu"] == 2000.0
    assert out["n_scored"] == 1 and out["mape_pct"] == pytest.approx(abs(by_id["both"]["error_pct"]))
    assert out["tflops"]["n"] == 1
    assert out["tflops"]["mape_pct"] == pytest.approx(abs(by_id["llama2-7b-4096"]["error_pct"]))


@pytest.mark.parametrize("value, why", [("half", "measured.extra.attention_flops"), (5, "measured.extra.attention_flops"),
                                        (float("nan"), "measured.tflops_per_gpu")])
def test_bad_tflops_rows_are_skipped_naming_the_field(value, why):
    row = _row(attention_flops=value) if why.endswith("attention_flops") else _row(tflops=value)
    run = _only(validate_rows([row]))
    assert run["error_pct"] is None and run["skipped"].startswith(why)


def test_cli_marks_tflops_runs_and_counts_them_as_scored(tmp_path):
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([_row(8192, 550.0)]))
    res = CliRunner().invoke(app, ["validate", str(path)])
    assert res.exit_code == 0, res.output
    assert "give only a model TFLOP/s figure" in res.output and " *" in res.output
    res = CliRunner().invoke(app, ["validate", str(path), "--json"])
    out = json.loads(res.output)
    assert out["tflops"]["n"] == 1 and out["n_scored"] == 0


def test_bundled_tflops_rows_are_scored_with_all():
    from autotune.datasets import dataset_path
    from autotune.validate import load_runs
    rows = [copy.deepcopy(r) for r in load_runs(dataset_path("public"))
            if not r.get("usable") and r["source"].get("group") == "Megatron-LM README"
            and r["measured"].get("tflops_per_gpu")]
    out = validate_rows(rows, only_usable=False)
    assert out["tflops"]["n"] == len(rows) == 9
    # the Megatron-LM README's weak-scaling table (H100, 2023-24 code: every score counted), out of sample
    assert out["tflops"]["mape_pct"] < 15.0


def narayanan_eq3_flops_per_token(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Narayanan et al. 2021 eq. 3 over one token: full recomputation counted, every attention score counted."""
    return 96 * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def test_a_figure_that_counts_the_recomputation_is_read_with_the_hardware_flops():
    # a GPT row whose source gives its percentage of peak as hfu (BLOOM, Narayanan et al.): the TFLOP/s figure
    # counts the recomputation forward and every attention score, as eq. 3 does
    row = _row(2048, 140.0)
    row["model"] = {**row["model"], "name": "GPT 1.3B", "layers": 24, "hidden": 2048, "ffn_hidden": 8192,
                    "heads": 16, "kv_heads": 16, "vocab": 51200}
    row["measured"]["hfu"] = 0.45
    run = _only(validate_rows([row]))
    assert run["compared_on"] == "hardware TFLOP/s (attention counted full)"
    golden = 140e12 / narayanan_eq3_flops_per_token(24, 2048, 2048, 51200)
    assert run["measured_tokens_per_s_per_gpu"] == pytest.approx(golden, rel=3e-3)


def test_calibrate_says_it_does_not_fit_tflops_only_runs(tmp_path):
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([_row(8192, 550.0)]))
    res = CliRunner().invoke(app, ["calibrate", str(path), "--gpu", "h100", "-o", str(tmp_path / "cal.json")])
    assert res.exit_code == 2
    assert "1 give only a FLOP rate" in res.output and "Traceback" not in res.output


def test_a_bare_mfu_is_a_share_of_the_gpus_bf16_peak():
    # H100 SXM dense bf16: 989.4 TFLOP/s (NVIDIA H100 datasheet); 0.5 of it as model TFLOP/s
    row = _row(4096, 600.0)
    row["measured"] = {"tflops_per_gpu": None, "tokens_per_s_per_gpu": None, "iteration_time_s": None, "mfu": 0.5}
    run = _only(validate_rows([row]))
    golden = 0.5 * 989.4e12 / nemo_llama2_flops_per_token(4096, causal=False)
    assert run["measured_tokens_per_s_per_gpu"] == pytest.approx(golden, rel=3e-3)
    assert run["compared_on"] == "model TFLOP/s (attention counted full, mfu x the GPU's bf16 peak)"


@pytest.mark.parametrize("change, why", [({"mfu": 1.5}, "at most 1"), ({"mfu": 0.4, "fp8": True}, "which peak")])
def test_a_share_of_peak_that_cannot_be_read_is_skipped(change, why):
    row = _row(4096, 600.0)
    row["measured"] = {"tflops_per_gpu": None, "mfu": change["mfu"]}
    if change.get("fp8"):
        row["plan"]["precision_key"] = "fp8"
    run = _only(validate_rows([row]))
    assert run["error_pct"] is None and run["skipped"].startswith("measured.mfu") and why in run["skipped"]


@pytest.mark.parametrize("measured, why", [
    ({"tflops_per_gpu": 1e300}, "measured.tflops_per_gpu: 1e+300 is above the GPU's dense bf16 peak"),
    ({"tflops_per_gpu": 1000.0}, "measured.tflops_per_gpu: 1000.0 is above the GPU's dense bf16 peak (989 TFLOP/s)"),
    ({"tflops_per_gpu": 5e-324}, "measured.tflops_per_gpu: 5e-324 gives"),
    ({"tokens_per_s_per_gpu": 5e-324}, "measured.tokens_per_s_per_gpu: 5e-324 gives"),
])
def test_a_figure_whose_error_cannot_be_finite_is_skipped_not_dropped(measured, why):
    # 1e300 TFLOP/s overflowed the derived tokens/s to inf, a subnormal one the error: the run was neither scored nor
    # skipped, and the command said "none of the 0 runs could be scored"
    row = _row()
    row["measured"] = {"tflops_per_gpu": None, **measured}
    out = validate_rows([row])
    run = _only(out)
    assert run["error_pct"] is None and run["skipped"].startswith(why)
    assert out["n_skipped"] == 1


@pytest.mark.parametrize("stated, count", [("CAUSAL", "causal"), (" full", "full"), ("Causal\n", "causal")])
def test_a_stated_attention_count_is_read_as_the_other_keys_are(stated, count):
    # plan.precision_key and plan.recompute_key are read without case or surrounding blanks; so is this one
    assert attention_flops_count(_row(attention_flops=stated)) == count


def _published(pick, n: int) -> list:
    """Bundled usable runs that publish both tokens/s and a TFLOP/s figure, as (tokens/s, the row without it)."""
    from autotune.datasets import dataset_path
    from autotune.validate import load_runs
    out = []
    for r in load_runs(dataset_path("public")):
        if r.get("usable") and r["measured"].get("tflops_per_gpu") and pick(r):
            row = copy.deepcopy(r)
            tok = row["measured"]["tokens_per_s_per_gpu"]
            row["measured"].update(tokens_per_s_per_gpu=None, iteration_time_s=None)
            out.append((tok, row))
    return out[:n]


def test_megatron_bridge_tables_count_causal_attention():
    # a Megatron-Bridge table publishes tokens/s and model TFLOP/s side by side: read with the causal count (the
    # source's), the figure gives back the published tokens/s; read full (the rule before), 18 % too few here
    runs = _published(lambda r: "Qwen3" in r["id"] and "Megatron-Bridge" in r["source"]["title"], 3)
    assert len(runs) == 3
    for tok, row in runs:
        run = _only(validate_rows([row]))
        assert run["compared_on"] == "model TFLOP/s (attention counted causal)"
        assert run["measured_tokens_per_s_per_gpu"] == pytest.approx(tok, rel=0.01)


def test_narayanan_table_2_gives_hardware_tflops_without_a_percentage_of_peak():
    # Table 2 (PTD-P vs ZeRO-3) gives TFLOP/s and no percentage: the figure still counts the recomputation (eq. 3);
    # read as model TFLOP/s, the derived tokens/s was 4/3 of eq. 3's
    ((_, row),) = _published(lambda r: r["id"] == "narayanan21-t2-ptdp-175B-384gpu", 1)
    assert row["measured"]["hfu"] is None and row["measured"]["mfu"] is None
    m = row["model"]
    run = _only(validate_rows([row]))
    assert run["compared_on"] == "hardware TFLOP/s (attention counted full)"
    golden = row["measured"]["tflops_per_gpu"] * 1e12 / narayanan_eq3_flops_per_token(
        m["layers"], m["hidden"], m["seq_len"], m["vocab"] or 51200)
    assert run["measured_tokens_per_s_per_gpu"] == pytest.approx(golden, rel=3e-3)
