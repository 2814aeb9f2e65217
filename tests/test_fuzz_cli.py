"""The CLI contract under hostile input (issue 12), for every command, fuzzed with hypothesis.

Whatever the input: exit code 0, 2 or 3 (1 only for a bug, which fails here); at most one line on
stderr, `error: <field>: <reason>` when the exit code is not 0; never a traceback; with --json,
stdout is strict JSON (no NaN / Infinity); no input file is lost or overwritten, no report
replaced. In process through typer's CliRunner (fast); the cases that would exhaust memory run in
a subprocess under an address-space limit. Problems are tiny (8 GPUs), so scoring stays cheap.
Deeper runs on demand: FUZZ_N=400 (examples per test) and FUZZ_RANDOM=1 (fresh seeds instead of the fixed ones).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from cli.common import configure_compile_cache, print_plans
from cli.main import app

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64", "--seq-len", "4096"]
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_N", 25)), deadline=None, derandomize=os.environ.get("FUZZ_RANDOM") is None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

runner = CliRunner()


def run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


def _no_constants(name: str):
    raise AssertionError(f"non-standard JSON constant {name} on stdout")


def assert_contract(result, *, as_json: bool = False) -> None:
    """Exit 0/2/3, at most one stderr line (exactly one `error:` line on failure), no traceback,
    strict JSON on stdout with --json."""
    out, err = result.stdout, result.stderr
    assert result.exit_code in (0, 2, 3), (result.exit_code, err, repr(result.exception))
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) <= 1, err
    if result.exit_code != 0:
        assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > 8, err
    if as_json and result.exit_code == 0:
        json.loads(out, parse_constant=_no_constants)


# ---------------------------------------------------------------------------------------------
# Flags: random values for every problem flag of every command
# ---------------------------------------------------------------------------------------------

HOSTILE_INTS = st.one_of(st.integers(-3, 5000), st.integers(2 ** 31 - 2, 2 ** 31 + 2), st.integers(10 ** 19, 10 ** 21),
                         st.just("9" * 5000), st.just("²"), st.just("1e3"), st.just(""))
HOSTILE_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just("1e-300"), st.just("inf"),
                           st.just("nan"), st.just("-0"), st.just("1e400"))
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)

FLAG_VALUES = {
    "--gpus": HOSTILE_INTS, "--global-batch": HOSTILE_INTS, "--seq-len": HOSTILE_INTS,
    "--gpus-per-node": HOSTILE_INTS, "--inter-node-bw": HOSTILE_FLOATS, "--intra-node-bw": HOSTILE_FLOATS,
    "--memory-limit-gb": HOSTILE_FLOATS, "--precision": st.sampled_from(["bf16", "fp8", "fp4", "FP8", "int4", ""]),
    "--gpu": st.sampled_from(["h100", "h100-80gb", "a100-40gb", "nope", "", "H100 "]),
    "--model": st.one_of(st.sampled_from(["llama3-8b", "mixtral-8x7b", "none", "", "/dev/zero", "/", "x.json"]), TEXT),
}


@st.composite
def flag_sets(draw):
    """SMALL with a few flags replaced by hostile values."""
    args = dict(zip(SMALL[::2], SMALL[1::2]))
    for flag in draw(st.lists(st.sampled_from(sorted(FLAG_VALUES)), min_size=1, max_size=3, unique=True)):
        args[flag] = str(draw(FLAG_VALUES[flag]))
    return [x for kv in args.items() for x in kv]


@FUZZ
@given(command=st.sampled_from(["search", "predict", "explain"]), flags=flag_sets(), as_json=st.booleans())
def test_fuzz_problem_flags(command, flags, as_json, tmp_path_factory):
    extra = {"search": ["--no-save", "--no-sensitivity", "--strategy", "exhaustive"],
             "predict": ["--plan", "tp=1,pp=1"], "explain": ["--plan", "tp=1,pp=1"]}[command]
    result = run(command, *flags, *extra, *(["--json"] if as_json else []))
    assert_contract(result, as_json=as_json)


#: the framework options (Megatron's names): valued flags with legal, illegal and odd values, and switches
FRAMEWORK_VALUES = {
    "--framework": st.sampled_from(["megatron", "deepspeed", "jax", "torch", ""]),
    "--attention-backend": st.sampled_from(["flash", "fused", "unfused", "auto", ""]),
    "--fp8-recipe": st.sampled_from(["delayed", "tensorwise", "mxfp8", "blockwise", "nvfp4", ""]),
    "--moe-token-dispatcher-type": st.sampled_from(["alltoall", "allgather", "flex", "deepep"]),
    "--cuda-graph-impl": st.sampled_from(["none", "local", "transformer_engine", "full_iteration", "x"]),
    "--cuda-graph-modules": st.sampled_from(["attn", "mlp", "moe", "moe_router,moe_preprocess", "attn,,", "?"]),
    "--cross-entropy-fusion-impl": st.sampled_from(["native", "te", "x"]),
}
FRAMEWORK_SWITCHES = ["tp-comm-overlap", "fp8-param-gather", "overlap-moe-expert-parallel-comm", "overlap-grad-reduce",
                      "overlap-param-gather", "gradient-accumulation-fusion", "moe-permute-fusion",
                      "cross-entropy-loss-fusion", "fp8-dot-product-attention"]


@st.composite
def framework_sets(draw):
    """A dense or MoE problem at some precision on some GPU, with a random set of framework options."""
    args = ["--model", draw(st.sampled_from(["llama3-8b", "mixtral-8x7b"])),
            "--gpu", draw(st.sampled_from(["h100", "b200", "a100-80gb"])), "--gpus", "8", "--global-batch", "64",
            "--seq-len", "4096", "--precision", draw(st.sampled_from(["bf16", "fp8", "fp4", "fp32"]))]
    for flag in draw(st.lists(st.sampled_from(sorted(FRAMEWORK_VALUES)), max_size=3, unique=True)):
        args += [flag, draw(FRAMEWORK_VALUES[flag])]
    for name in draw(st.lists(st.sampled_from(FRAMEWORK_SWITCHES), max_size=4, unique=True)):
        args.append(f"--{name}" if draw(st.booleans()) else f"--no-{name}")
    return args


@FUZZ
@given(command=st.sampled_from([["search", "--no-save", "--no-sensitivity", "--strategy", "exhaustive"],
                                ["predict", "--plan", "tp=1,pp=1"], ["export", "--plan", "tp=1,pp=1", "--to", "megatron"],
                                ["export", "--plan", "tp=1,pp=1", "--to", "bridge"]]),
       flags=framework_sets(), as_json=st.booleans())
def test_fuzz_framework_options(command, flags, as_json):
    """Every combination of Megatron's options either runs or is refused in one line (exit 2): the rules between
    them (fp8 recipe / GPU, fp8 attention / backend, CUDA-graph modules / impl, ...) never crash."""
    json_flag = ["--json"] if as_json and command[0] != "export" else []
    result = run(*command, *flags, *json_flag)
    assert_contract(result, as_json=bool(json_flag))


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------

KNOB = st.sampled_from(["tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs", "recompute", "sp", "zero",
                        "first_layers", "last_layers", "recompute_layers", "layout", "recompute_modules", "bogus"])
VALUE = st.one_of(st.integers(-2, 64).map(str), st.sampled_from(["true", "False", "full", "selective", "none",
                                                                  "9" * 40, "1e3", "", "=", "Et*3|t*3L"]), TEXT)


@FUZZ
@given(parts=st.lists(st.tuples(KNOB, VALUE), max_size=5), as_json=st.booleans(),
       command=st.sampled_from([["predict"], ["export", "--to", "megatron"], ["export", "--to", "torchtitan"]]))
def test_fuzz_plans(parts, as_json, command):
    plan = ",".join(f"{k}={v}" for k, v in parts)
    result = run(*command, *SMALL, "--plan", plan, *(["--json"] if as_json else []))
    assert_contract(result, as_json=as_json)


# ---------------------------------------------------------------------------------------------
# Files: random model configs, cluster files and calibration files
# ---------------------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10, 10 ** 12), st.integers(10 ** 30, 10 ** 40),
                         st.floats(allow_nan=True, allow_infinity=True), TEXT)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
HF_KEYS = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "vocab_size", "head_dim", "max_position_embeddings", "num_local_experts", "num_experts_per_tok",
           "n_routed_experts", "moe_intermediate_size", "sliding_window", "tie_word_embeddings", "decoder_sparse_step",
           "mlp_only_layers", "text_config", "layer_types", "rope_scaling", "sliding_window_pattern"]
LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1024,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000}


@st.composite
def hf_configs(draw):
    cfg = dict(LLAMA)
    cfg["model_type"] = draw(st.sampled_from(["llama", "mistral", "mixtral", "qwen3_moe", "deepseek_v3", "gemma2",
                                              "gemma3", "gpt2", "gpt_oss", "bert", None]))
    for key in draw(st.lists(st.sampled_from(HF_KEYS), max_size=4, unique=True)):
        cfg[key] = draw(JSON_VALUES)
    return cfg


@FUZZ
@given(cfg=hf_configs(), as_json=st.booleans())
def test_fuzz_model_configs(cfg, as_json, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(cfg))
    result = run("predict", "--model", path, *SMALL[2:], "--plan", "tp=1,pp=1", *(["--json"] if as_json else []))
    assert_contract(result, as_json=as_json)


CLUSTER_KEYS = ["gpu", "gpus", "gpus_per_node", "nvlink_domain_size", "intra_node_bandwidth_gbps",
                "inter_node_bandwidth_gbps", "fabric_bandwidth_factor", "intra_node_latency_us", "host_op_x", "sites",
                "bogus"]


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(CLUSTER_KEYS), JSON_VALUES, max_size=4), as_yaml=st.booleans())
def test_fuzz_cluster_files(fields, as_yaml, tmp_path_factory):
    import yaml
    folder = tmp_path_factory.mktemp("cluster")
    data = {"gpu": "h100", "gpus": 8, **fields}
    path = folder / ("c.yaml" if as_yaml else "c.json")
    path.write_text(yaml.safe_dump(data) if as_yaml else json.dumps(data))
    result = run("predict", "--model", "llama3-8b", "--cluster", path, "--global-batch", "64", "--seq-len", "4096",
                 "--plan", "tp=1,pp=1", "--json")
    assert_contract(result, as_json=True)


PARAM_NAMES = ["gemm_eff_max", "hbm_eff", "mem_fragmentation", "moe_imbalance", "inter_bw_eff", "bogus"]


@FUZZ
@given(params=st.dictionaries(st.sampled_from(PARAM_NAMES), JSON_VALUES, max_size=3))
def test_fuzz_calibration_files(params, tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    path.write_text(json.dumps({"gpu": "h100", "params": params}))
    result = run("predict", *SMALL, "--plan", "tp=1,pp=1", "--calibration", path, "--json")
    assert_contract(result, as_json=True)
    if result.exit_code == 0:                 # accepted values are inside the physical bounds
        report = json.loads(result.stdout)
        assert 0 < report["mfu"] < 1 and report["step_time_s"] > 0


# ---------------------------------------------------------------------------------------------
# Named hostile inputs from the issue (each once)
# ---------------------------------------------------------------------------------------------

LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n" \
         "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\ngpu: h100\n"


@pytest.mark.parametrize("name, text, needle", [
    ("laughs.yaml", LAUGHS, "aliases"),
    ("dup.yaml", "gpu: h100\ngpus: 8\ngpu: a100-80gb\n", "twice"),
    ("dup.json", '{"gpu": "h100", "gpus": 8, "gpu": "b200"}', "twice"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "nests deeper"),
    ("big.json", '{"gpus": ' + "9" * 5000 + "}", "cluster_file"),
    ("slow.yaml", "gpu: h100\ngpus: 8\ninter_node_bandwidth_gb_per_s: 1.0e-300\n", "inter_node_bandwidth"),
    ("late.yaml", "gpu: h100\ngpus: 8\nintra_node_latency_us: 1.0e+300\n", "intra_node_latency_us"),
])
def test_hostile_cluster_files(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    result = run("search", "--model", "llama3-8b", "--gpus", "8", "--cluster", path, "--no-save")
    assert_contract(result)
    assert result.exit_code == 2 and needle in result.stderr


@pytest.mark.parametrize("args, field", [
    (["--model", "/dev/zero"], "model"),
    (["--model", "/tmp"], "model"),
    (["--calibration", "/dev/zero"], "calibration"),
    (["--global-batch", str(10 ** 20)], "global"),
    (["--gpus", "2147483648"], "gpus"),
    (["--gpus-per-node", "9999999967"], "gpus"),
    (["--gpus", "²"], "gpus"),
    (["--inter-node-bw", "1e-300"], "inter_node_bw"),
    (["--memory-limit-gb", "inf"], "memory-limit"),
    (["--memory-limit-gb", "nan"], "memory-limit"),
    (["--gpu", "h100-80gb", "--out", "/dev/null/x"], "out"),
    (["--gpus", "8-2000000000"], "gpus"),
    (["--gpus", "9" * 5000], "gpus"),
    (["--seed", "-1"], "seed"),
    (["--top", "99999999999"], "top"),                # was MemoryError: "input: too large ..." naming no field
    (["--top", str(2 ** 63)], "top"),                 # was an internal error (numpy's dimension limit)
])
def test_hostile_flags_name_the_field(args, field):
    flags = dict(zip(SMALL[::2], SMALL[1::2])) | dict(zip(args[::2], args[1::2]))
    result = run("search", *[x for kv in flags.items() for x in kv], "--strategy", "exhaustive")
    assert_contract(result)
    assert result.exit_code == 2 and field in result.stderr.split(":", 2)[1] + result.stderr, result.stderr


def test_huge_moe_config_is_refused_before_any_loop(tmp_path):
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 10 ** 9, "hidden_size": 64, "intermediate_size": 64,
           "num_attention_heads": 2, "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 1,
           "moe_intermediate_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = run("explain", "--model", tmp_path, "--gpu", "h100", "--gpus", "8")
    assert_contract(result)
    assert result.exit_code == 2 and "4,096" in result.stderr


def test_calibration_outside_bounds_is_refused(tmp_path):
    for params, needle in (({"gemm_eff_max": 0}, "gemm_eff_max"), ({"mem_fragmentation": -1e15}, "mem_fragmentation"),
                           ({"hbm_eff": 1000}, "hbm_eff")):
        path = tmp_path / "cal.json"
        path.write_text(json.dumps({"gpu": "h100", "params": params}))
        result = run("predict", *SMALL, "--plan", "tp=1", "--calibration", path)
        assert_contract(result)
        assert result.exit_code == 2 and needle in result.stderr and "range" in result.stderr


# ---------------------------------------------------------------------------------------------
# Exit codes of the analysis commands
# ---------------------------------------------------------------------------------------------

def test_explain_and_whatif_exit_3_when_nothing_fits():
    big = ["--model", "llama3-70b", "--gpus", "8", "--global-batch", "16", "--seq-len", "4096"]
    for args in (["explain", *big, "--gpu", "h100"], ["whatif", *big, "--gpu", "h100", "--gpu", "a100-40gb"]):
        result = run(*args)
        assert_contract(result)
        assert result.exit_code == 3 and "memory" in result.stderr
        assert "memory: memory:" not in result.stderr


def test_explain_plan_that_does_not_fit_exits_3_like_predict():
    args = ["--model", "llama3-70b", "--gpu", "h100", "--gpus", "8", "--global-batch", "16", "--seq-len", "4096",
            "--plan", "tp=8,recompute=none"]
    for command in ("predict", "explain"):
        result = run(command, *args)
        assert_contract(result)
        assert result.exit_code == 3, (command, result.stderr)


# ---------------------------------------------------------------------------------------------
# Files are never lost or overwritten
# ---------------------------------------------------------------------------------------------

def test_calibrate_refuses_to_write_over_its_input(tmp_path):
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([]))
    before = runs.read_bytes()
    for out in (runs, tmp_path / "." / "runs.json"):
        result = run("calibrate", runs, "--gpu", "h100", "-o", out)
        assert_contract(result)
        assert result.exit_code == 2 and "out" in result.stderr
    assert runs.read_bytes() == before


def test_concurrent_reports_into_one_folder_are_all_kept(tmp_path):
    from autotune.report import save_report
    report = {"tool": "autotune", "version": "0", "kind": "search", "created": "2026-01-01T00:00:00+00:00",
              "problem": {"model": {"name": "m"}, "gpu": {"name": "g"}, "cluster": {"num_gpus": 8},
                          "job": {"global_batch": 1, "seq_len": 1, "precision": "bf16"}},
              "strategy": "exhaustive", "calibration": "defaults", "best": None, "top": [],
              "space": {"total": 0, "legal": 0, "fitting": 0, "scored": 0, "illegal": {}}, "explanation": "",
              "elapsed_s": float("nan")}
    saved: list = []
    render = lambda i: saved.append(save_report(dict(report, explanation=str(i)), str(tmp_path)))  # noqa: E731
    import autotune.report as rep
    original = rep.render_markdown
    rep.render_markdown = lambda r: r["explanation"]          # the Markdown of an empty report
    try:
        threads = [threading.Thread(target=render, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        rep.render_markdown = original
    jsons = sorted(p for p in tmp_path.iterdir() if p.suffix == ".json")
    assert len(jsons) == 8 and len({p for p, _ in saved}) == 8
    texts = {json.loads(p.read_text(), parse_constant=_no_constants)["explanation"] for p in jsons}
    assert texts == {str(i) for i in range(8)}                 # none replaced, none torn
    assert json.loads(jsons[0].read_text())["elapsed_s"] is None    # NaN written as null
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_unwritable_out_fails_before_searching(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run("search", *SMALL, "--out", blocker / "sub")
    assert_contract(result)
    assert result.exit_code == 2 and "out" in result.stderr and blocker.read_text() == "x"


# ---------------------------------------------------------------------------------------------
# Output: 80-column tables, the compile cache, bugs
# ---------------------------------------------------------------------------------------------

def test_plan_table_fits_80_columns_without_ellipsis():
    plan = {"tp": 8, "pp": 16, "dp": 128, "cp": 2, "ep": 1, "etp": 1, "vpp": 4, "mbs": 1, "recompute": "selective",
            "sp": True, "zero": 1, "first_layers": 7, "last_layers": 0, "recompute_layers": 0}
    rep = {"plan": plan, "step_time_s": 12.3456, "tokens_per_s_per_gpu": 123456.0, "model_tflops_per_gpu": 456.0,
           "mfu": 0.456, "memory_gb": {"total": 71.23}, "fits": True}
    other = dict(rep, plan=dict(plan, recompute_modules=["core_attn", "layernorm"]), fits=False)
    for reports in ([rep, rep], [dict(rep, plan=dict(plan, recompute_modules=[])), other]):
        con = Console(width=80, record=True, force_terminal=True, color_system=None)
        print_plans(con, reports)
        text = con.export_text()
        assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
        for value in ("12.346", "123,456", "456", "45.6%", "71.2", "DP128", "Recompute=selective", "SP=on",
                      "First7", "yes"):
            assert value in text, value
    assert "NO" in text and "core_attn+layernorm" in text       # the knob the plans differ in is shown
    wide = Console(width=200, record=True, color_system=None)
    print_plans(wide, [rep])
    assert "Recompute" in wide.export_text().splitlines()[2]     # a wide terminal: one column per knob


def test_unwritable_compile_cache_is_disabled_quietly(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_JAX_CACHE", "/dev/null/cache")
    assert configure_compile_cache() is None


def test_internal_errors_are_one_line_with_a_bug_hint(monkeypatch):
    import autotune.problem                       # predict parses --plan with it before importing autotune.api
    monkeypatch.setattr(autotune.problem, "plan_from_text", lambda *a: {}["boom"])
    result = run("predict", *SMALL, "--plan", "tp=1")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "bug" in result.stderr and "KeyError" in result.stderr


# ---------------------------------------------------------------------------------------------
# Subprocesses under a memory limit: what would exhaust memory is refused cheaply
# ---------------------------------------------------------------------------------------------

#: the CLI with 1 GiB of address space (set inside the child: no preexec_fn in a threaded parent)
LIMITED_CLI = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
               "from cli.main import app; app()")


@pytest.mark.parametrize("name, text, args", [
    ("laughs.yaml", LAUGHS.replace("gpu: h100\n", "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d]\ngpu: h100\n"),
     ["--cluster"]),
    ("config.json", json.dumps({**LLAMA, "model_type": "mixtral", "num_hidden_layers": 10 ** 9,
                                "num_local_experts": 8, "num_experts_per_tok": 2}), ["--model"]),
    (None, None, ["--model", "/dev/zero"]),
    (None, None, ["--calibration", "/dev/zero"]),
])
def test_memory_bombs_in_a_subprocess(tmp_path, name, text, args):
    if name:
        (tmp_path / name).write_text(text)
        args = [*args, str(tmp_path / name)]
    flags = dict(zip(SMALL[::2], SMALL[1::2])) | dict(zip(args[::2], args[1::2]))
    cmd = [sys.executable, "-c", LIMITED_CLI, "search", "--no-save", *[x for kv in flags.items() for x in kv]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "AUTOTUNE_JAX_CACHE": ""})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("text, needle", [
    (None, "regular file"),                                              # /dev/zero
    ('[{"id": "a", "id": "b"}]', "twice"),
    ("[" * 5000 + "]" * 5000, "nests deeper"),
    ('{"runs": NaN', "valid JSON"),
    ("[1, 2, 3]", "run 0 is not a JSON object"),                         # calibrate said "no usable run for GPU"
    ('{"runs": [{"id": "a"}, "b"]}', "run 1 is not a JSON object"),
])
def test_hostile_runs_files(tmp_path, text, needle):
    path = "/dev/zero"
    if text is not None:
        path = tmp_path / "runs.json"
        path.write_text(text)
    for args in (["validate", path, "--json"], ["calibrate", path, "--gpu", "h100", "-o", tmp_path / "cal.json"]):
        result = run(*args)
        assert_contract(result)
        assert result.exit_code == 2 and needle in result.stderr, result.stderr
    assert not (tmp_path / "cal.json").exists()


@pytest.mark.parametrize("flag, value", [("--steps", "-5"), ("--rounds", "-1"), ("--holdout-frac", "1.5"),
                                         ("--seed", "-1")])
def test_calibrate_refuses_settings_that_would_write_an_unfitted_file(tmp_path, flag, value):
    runs = tmp_path / "runs.json"
    runs.write_text("[]")
    result = run("calibrate", runs, "--gpu", "h100", "-o", tmp_path / "cal.json", flag, value)
    assert_contract(result)
    assert result.exit_code == 2 and flag in result.stderr and not (tmp_path / "cal.json").exists()


def test_cli_constants_spelled_for_start_up_match_their_modules():
    import autotune.check
    import autotune.export
    import autotune.launch
    from cli import export_cmds
    assert export_cmds.TARGETS == autotune.export.TARGETS
    assert export_cmds.LAUNCHERS == autotune.launch.LAUNCHERS
    assert export_cmds.DEFAULT_MAX_MEMORY_FRAC == autotune.check.DEFAULT_MAX_MEMORY_FRAC
    import autotune.ask_tell
    from cli import optuna_cmds
    from search_spaces.optuna_space import GpuRange
    assert optuna_cmds.STALE_AFTER_S == autotune.ask_tell.STALE_AFTER_S
    assert optuna_cmds.GpuRange is GpuRange and optuna_cmds.is_gpu_range(optuna_cmds.parse_search_gpus("8-32"))
    assert not optuna_cmds.is_gpu_range(optuna_cmds.parse_search_gpus("8"))
    probe = subprocess.run([sys.executable, "-c", "import sys, cli.main; print(sorted(m for m in ('jax', 'optuna', 'numpy') "
                            "if m in sys.modules))"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr     # building the CLI imports none of them
