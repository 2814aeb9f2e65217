"""GPU spec fields added after the first presets (SMs and clock, Blackwell Ultra's exponential rate, the host CPU's
factor): `autotune gpus` lists them, reports saved before a field existed still load (the field's default), and a
damaged value in a saved report is refused in one line naming it (exit 2)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app

SAVED = Path(__file__).parents[1] / "results" / "reference" / "dense_llama3-70b_h100x512.json"


@pytest.mark.parametrize("column, expected, header", [
    ("exp_throughput_x", {"gb300": 2.0, "gb200": 1.0}, "exp"),          # Blackwell Ultra's doubled MUFU.EX2
    ("sms", {"b200": 148}, "SMs"),
    ("sm_clock_mhz", {"b200": 1980.0}, "MHz"),
    ("host_op_x", {"gb200": 2.75, "b200": 1.0}, "host"),                # Grace vs x86 hosts (TE issue #2053)
])
def test_gpus_command_lists_the_field(column, expected, header):
    result = CliRunner().invoke(app, ["gpus", "--json"])
    assert result.exit_code == 0
    rows = {g["name"]: g for g in json.loads(result.stdout)["gpus"]}
    for gpu, value in expected.items():
        assert rows[gpu][column] == value
    table = CliRunner().invoke(app, ["gpus"], env={"COLUMNS": "220"})
    assert table.exit_code == 0 and header in table.stdout


@pytest.mark.parametrize("fields, saved, bad", [
    (("sm_count", "sm_clock_hz"), (132, 1.98e9), {"sm_count": "abc"}),    # old reports: H100's balance
    (("host_op_x",), (1.0,), {"host_op_x": -3}),                         # old reports: an x86 host
])
def test_saved_reports_without_the_field_load_and_bad_ones_are_named(tmp_path, fields, saved, bad):
    report = json.loads(SAVED.read_text())
    gpu = report["problem"]["gpu"]
    assert tuple(gpu[f] for f in fields) == saved
    old = dict(report, problem=dict(report["problem"], gpu={k: v for k, v in gpu.items() if k not in fields}))
    damaged = dict(report, problem=dict(report["problem"], gpu=dict(gpu, **bad)))
    for name, doc in (("old", old), ("bad", damaged)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    ok = CliRunner().invoke(app, ["export", "--report", str(tmp_path / "old.json"), "--to", "megatron"])
    assert ok.exit_code == 0 and "--num-layers 80" in ok.stdout
    refused = CliRunner().invoke(app, ["export", "--report", str(tmp_path / "bad.json"), "--to", "megatron"])
    assert refused.exit_code == 2 and next(iter(bad)) in refused.output and "Traceback" not in refused.output
