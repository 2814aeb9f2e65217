"""`autotune models | gpus | clusters`: list the presets and shipped cluster files (issue 13).

Read from the same registries the other commands resolve names with (`costmodels.presets`), so a
name listed here is a name `--model` / `--gpu` / `--cluster` accept. No JAX is imported.
"""
from __future__ import annotations

import typer
from rich.table import Table

from cli.common import EXIT_OK, print_json, print_table, stdout_console
from cli.options import JsonOpt


def _billions(n: int) -> str:
    return f"{n / 1e9:,.1f} B"


def model_rows() -> list[dict]:
    from costmodels.presets import MODEL_PRESETS
    rows = []
    for name, m in MODEL_PRESETS.items():
        counts = m.param_counts()
        rows.append({"name": name, "kind": "MoE" if m.is_moe else "dense", "parameters": counts["total"],
                     "active_parameters": counts["active"], "layers": m.num_layers, "hidden_size": m.hidden_size,
                     "attention_heads": m.num_attention_heads, "kv_heads": m.num_kv_heads,
                     "experts": m.num_experts, "experts_per_token": m.experts_per_token,
                     "mtp_num_layers": m.mtp_num_layers, "context": m.max_seq_len, "source": m.source})
    return rows


def gpu_rows() -> list[dict]:
    from costmodels.presets import GPU_ALIASES, GPU_PRESETS
    return [{"name": name, "family": g.family, "bf16_tflops": g.peak_flops_bf16 / 1e12,
             "fp8_tflops": g.peak_flops_fp8 / 1e12, "fp4_tflops": g.peak_flops_fp4 / 1e12,
             "hbm_gib": g.hbm_bytes / 2 ** 30, "hbm_tbps": g.hbm_bandwidth_bytes_per_s / 1e12,
             "gpus_per_node": g.gpus_per_node, "nvlink_gbps": g.intra_node_bw_bytes_per_s / 1e9,
             "nic_gbps": g.inter_node_bw_bytes_per_s / 1e9, "sms": g.sm_count, "sm_clock_mhz": g.sm_clock_hz / 1e6,
             "exp_throughput_x": g.exp_throughput_x, "host_op_x": g.host_op_x,
             "aliases": sorted(a for a, target in GPU_ALIASES.items() if target == name)}
            for name, g in GPU_PRESETS.items()]


def cluster_rows() -> list[dict]:
    from costmodels.presets import CLUSTER_DIR, build_cluster, shipped_cluster_files
    rows = []
    for file in shipped_cluster_files():
        c = build_cluster(cluster_file=str(CLUSTER_DIR / file))
        rows.append({"file": file, "name": c.name, "gpu": c.gpu.name, "gpus": c.num_gpus,
                     "nvlink_domain": c.nvlink_domain_size, "inter_node_gbps": c.inter_node_bw_bytes_per_s / 1e9,
                     "fabric_bw_factor": c.fabric_bw_factor, "sites": c.num_sites})
    return rows


def _table(title: str, columns: list[tuple[str, str]], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for header, justify in columns:
        table.add_column(header, justify=justify)
    for row in rows:
        table.add_row(*row)
    return table


def models(as_json: JsonOpt = False) -> int:
    """List the model presets (`--model NAME`) with their parameter counts."""
    rows = model_rows()
    if as_json:
        print_json({"models": rows})
        return EXIT_OK
    print_table(stdout_console(), _table(
        "Model presets (--model NAME, or a Hugging Face config.json)",
        [("name", "left"), ("kind", "left"), ("params", "right"), ("active", "right"), ("layers", "right"),
         ("hidden", "right"), ("heads/kv", "right"), ("experts", "right"), ("context", "right")],
        [[r["name"], r["kind"], _billions(r["parameters"]), _billions(r["active_parameters"]),
          f"{r['layers']:,}" + (f" + {r['mtp_num_layers']} MTP" if r["mtp_num_layers"] else ""),
          f"{r['hidden_size']:,}", f"{r['attention_heads']}/{r['kv_heads']}",
          f"{r['experts_per_token']} of {r['experts']}" if r["experts"] else "-", f"{r['context']:,}"]
         for r in rows]))
    return EXIT_OK


def gpus(as_json: JsonOpt = False) -> int:
    """List the GPU presets (`--gpu NAME`) with their datasheet figures."""
    rows = gpu_rows()
    if as_json:
        print_json({"gpus": rows})
        return EXIT_OK
    print_table(stdout_console(), _table(
        "GPU presets (--gpu NAME); dense TFLOP/s, per-direction GB/s per GPU, SMs and boost MHz, exp = softmax exponential rate (2: Blackwell Ultra), host = host CPU time per framework op (1: a DGX H100's Xeon; Grace 2.75)",
        [("name", "left"), ("bf16", "right"), ("fp8", "right"), ("fp4", "right"), ("HBM GiB", "right"),
         ("HBM TB/s", "right"), ("node", "right"), ("NVLink GB/s", "right"), ("NIC GB/s", "right"),
         ("SMs", "right"), ("MHz", "right"), ("exp", "right"), ("host", "right"),
         ("also", "left")],
        [[r["name"], f"{r['bf16_tflops']:,.0f}", f"{r['fp8_tflops']:,.0f}" if r["fp8_tflops"] else "-",
          f"{r['fp4_tflops']:,.0f}" if r["fp4_tflops"] else "-", f"{r['hbm_gib']:,.0f}", f"{r['hbm_tbps']:.2f}",
          str(r["gpus_per_node"]), f"{r['nvlink_gbps']:,.0f}", f"{r['nic_gbps']:,.0f}", str(r["sms"] or "-"),
          f"{r['sm_clock_mhz']:,.0f}" if r["sms"] else "-", f"{r['exp_throughput_x']:g}",
          f"{r['host_op_x']:g}", ", ".join(r["aliases"]) or "-"]
         for r in rows]))
    return EXIT_OK


def clusters(as_json: JsonOpt = False) -> int:
    """List the shipped cluster files (`--cluster NAME`)."""
    rows = cluster_rows()
    if as_json:
        print_json({"clusters": rows})
        return EXIT_OK
    print_table(stdout_console(), _table(
        "Shipped cluster files (--cluster NAME; format: costmodels/presets/clusters/README.md)",
        [("file", "left"), ("GPU", "left"), ("GPUs", "right"), ("NVLink domain", "right"),
         ("inter-node GB/s", "right"), ("fabric factor", "right"), ("sites", "right")],
        [[r["file"], r["gpu"], f"{r['gpus']:,}", str(r["nvlink_domain"]), f"{r['inter_node_gbps']:,.0f}",
          f"{r['fabric_bw_factor']:g}", str(r["sites"])] for r in rows]))
    return EXIT_OK


def register(app: typer.Typer) -> None:
    for command in (models, gpus, clusters):
        app.command(command.__name__)(command)
