#!/usr/bin/env python
"""Build autotune/data/bridge_dense_runs.json: the dense Llama rows of Megatron-Bridge's published
performance tables (docs/performance-summary.md, the 26.08 container, and docs/performance-summary-archive.md,
25.09-26.06.01), in the validation row schema (shared/validation/README.md).

Not a pytest module. Run it against a git copy of NVIDIA-NeMo/Megatron-Bridge (no work tree needed):

    python tests/benchmarks/bridge_dense_rows.py /path/to/Megatron-Bridge.git [--rev 067f987df]

These rows are held out of every fit (autotune.datasets.TRAINING_DATASETS): the shared validation file has the
same pages' MoE rows only. Derived fields, as for those MoE rows: dp = GPUs / (tp x pp x cp); iteration time =
GBS x sequence / (tokens/s/GPU x GPUs). A table's parenthesized figures (25.09 / 25.11: the FP8-MX alternative,
sometimes with its own parallelism) become rows of their own, marked `alt`. The 25.09 tables give no precision
column: their page says FP8 current scaling, MX in parentheses. The FSDP column: > 0 is Megatron FSDP (ZeRO-3
here), 0 (or no column) Megatron DDP with the distributed optimizer.
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = None
REV = "HEAD"


def show(path):
    return subprocess.run(["git", "-C", REPO, "show", f"{REV}:{path}"], capture_output=True, text=True,
                          check=True).stdout

#: the tables' model names -> architecture (Meta's Llama-3 / 3.1 config.json files, as the presets have them)
MODELS = {
    "LLAMA3_8B": dict(name="Llama-3 8B", layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8,
                      vocab=128256, params_billion=8),
    "LLAMA3_70B": dict(name="Llama-3 70B", layers=80, hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8,
                       vocab=128256, params_billion=70),
    "LLAMA3.1_405B": dict(name="Llama-3.1 405B", layers=126, hidden=16384, ffn_hidden=53248, heads=128, kv_heads=8,
                          vocab=128256, params_billion=405),
}
#: the tables' sections -> the task (fine-tuning rows carry it in their id; its recipe says how it ran)
TASKS = {"Pre-Training Performance": "", "SFT Performance": "SFT", "LoRA Performance": "LoRA"}
GPU = {"DGX-H100": "h100", "DGX-B200": "b200", "DGX-B300": "b300", "DGX-GB200": "gb200", "DGX-GB300": "gb300"}



def cell(v, alt):
    """A table cell, or its parenthesized alternative ("64 (0)")."""
    v = v.strip()
    m = re.match(r"^([^()]*?)\s*\(([^()]*)\)\s*$", v)
    if m:
        return (m.group(2) if alt else m.group(1)).strip()
    return v



def num(v):
    v = v.replace(",", "").strip()
    if v in ("n/a", "", "-"):
        return None
    return float(v) if "." in v else int(v)



def parse(text, where):
    """The pre-training and fine-tuning (SFT, LoRA) rows of the dense models in one page's tables (per-model or
    per-system tables)."""
    rows = []
    release = section = model = system = None
    header = None
    for line in text.splitlines():
        if line.startswith("## "):
            m = re.search(r"(\d\d\.\d\d(?:\.\d\d)?) NeMo Container", line)
            release = m.group(1) if m else None
        elif line.startswith("### "):
            section = line[4:].strip()
        elif line.startswith("#### "):
            t = line[5:].strip()
            if t.startswith("Model:"):
                model, system = t[6:].strip(), None
            elif t.startswith("System:"):
                system, model = t[7:].strip(), None
        elif line.startswith("|") and "---" not in line:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] in ("System", "Model"):
                header = cells
                continue
            if header is None or section not in TASKS or release is None:
                continue
            d = dict(zip(header, cells))
            mdl, sysn = d.get("Model", model), d.get("System", system)
            if mdl not in MODELS:
                continue
            has_alt = any("(" in c for c in cells)
            for alt in ((False, True) if has_alt else (False,)):
                def g(k, alt=alt):
                    return cell(d[k], alt) if k in d else None
                # no precision column (25.09): FP8 current scaling, MX in parentheses (the page's footnote)
                prec = g("Precision") if "Precision" in d else ("FP8-MX" if alt else "FP8-CS")
                tok = num(g("Tokens / sec / GPU"))
                rows.append(dict(release=release, model=mdl, system=sysn, gpus=num(g("#-GPUs")), precision=prec,
                                 gbs=num(g("GBS")), mbs=num(g("MBS")), seq=num(g("Sequence Length")),
                                 fsdp=num(g("FSDP")) if "FSDP" in d else None, tp=num(g("TP")), pp=num(g("PP")),
                                 cp=num(g("CP")), vp=num(g("VP")), tokens=tok, tflops=num(g("Model TFLOP / sec / GPU")),
                                 alt=alt, where=where, task=TASKS[section]))
    return rows



def to_public(r):
    """One parsed row in the shared/validation row schema."""
    m = MODELS[r["model"]]
    gpu = GPU[r["system"]]
    prec = r["precision"]
    key = "bf16" if prec == "BF16" else ("fp4" if "FP4" in prec else "fp8")
    dp = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
    z = 3 if (r["fsdp"] or 0) > 0 else 0
    task = f"{r['task']}-" if r["task"] else ""
    rid = (f"mbridge-dense-{r['release']}-{r['model']}-{task}{r['system']}-{r['gpus']}g-{prec.replace(' ', '')}"
           f"{'-alt' if r['alt'] else ''}")
    seq = r["seq"]
    return {
        "id": rid,
        "source": {"title": "NVIDIA NeMo Megatron-Bridge 'Performance' summary (docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary)",
                   "table": f"{r['where']} :: {r['release']} container :: "
                            f"{r['task'] + ' ' if r['task'] else 'Pre-Training '}Performance :: {r['model']} / {r['system']}",
                   "locator": f"github NVIDIA-NeMo/Megatron-Bridge {r['where']} @ {REV_LABEL}",
                   "group": "Megatron-Bridge perf summary, dense (held out)"},
        "model": {"name": m["name"] + f" [{r['model']}]", **{k: v for k, v in m.items() if k != "name"}, "seq_len": seq},
        "hardware": {"gpu": r["system"].replace("DGX-", ""), "num_gpus": r["gpus"], "gpus_per_node": None if r["system"].startswith("DGX-GB") else 8,
                     "interconnect": (f"{r['system'][4:]} NVL72 rack-scale NVLink domain (72 GPUs)" if r["system"].startswith("DGX-GB") else r["system"]), "gpu_key": gpu},
        "plan": {"tp": r["tp"], "pp": r["pp"], "dp": dp, "cp": r["cp"], "ep": None, "vpp": r["vp"], "micro_batch": r["mbs"],
                 "global_batch": r["gbs"], "sequence_parallel": None, "recompute": None,
                 "distributed_optimizer_or_zero": f"{'Megatron FSDP' if z == 3 else 'DDP'} (FSDP={r['fsdp'] or 0} in table)" if r["fsdp"] is not None else "DDP (FSDP=0 in table)",
                 "precision": prec, "precision_key": key, "recompute_key": None, "zero_key": z},
        "measured": {"tflops_per_gpu": r["tflops"], "mfu": None, "hfu": None,
                     "iteration_time_s": round(r["gbs"] * seq / (r["tokens"] * r["gpus"]), 4), "tokens_per_s_per_gpu": r["tokens"],
                     "memory_gb": None, "extra": {"system": r["system"], "release": r["release"], "fsdp": r["fsdp"], "alt": r["alt"]}},
        "notes": (f"Megatron-Bridge perf summary, NeMo {r['release']} container, "
                  f"{'fine-tuning (' + r['task'] + ')' if r['task'] else 'pre-training'}. {r['system']}. "
                  "DP DERIVED = GPUs/(TP*PP*CP). iteration_time_s DERIVED = GBS*seq/(tokens_per_s_per_gpu*GPUs)."),
        "derived_fields": ["plan.dp", "measured.iteration_time_s"],
        "confidence": "high", "usable": True}



def main(argv=None):
    global REPO, REV, REV_LABEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("repo", help="a git directory of NVIDIA-NeMo/Megatron-Bridge")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "autotune" / "data" / "bridge_dense_runs.json"))
    args = ap.parse_args(argv)
    REPO, REV = args.repo, args.rev
    sha, date = subprocess.run(["git", "-C", REPO, "log", "-1", "--format=%h %cs", REV], capture_output=True, text=True,
                               check=True).stdout.split()
    REV_LABEL = f"{sha} ({date})"
    rows = (parse(show("docs/performance-summary.md"), "docs/performance-summary.md")
            + parse(show("docs/performance-summary-archive.md"), "docs/performance-summary-archive.md"))
    out = [to_public(r) for r in rows]
    ids = [r["id"] for r in out]
    assert len(set(ids)) == len(ids), "row ids must be unique"
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    print(f"{len(out)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
