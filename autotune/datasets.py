"""The measured runs shipped with the package (`autotune/data/`, provenance and licence in its README).

`public` is a copy of shared/validation/public_runs.json (published large-model runs, each row citing
its source); `small-scale` of shared/validation/small_scale_runs.json (vTrain's Megatron-DeepSpeed
measurements, MIT licence, copyright 2024 VIA Research Group at KAIST). Bundling them lets any clone
reproduce the README's accuracy figures: `autotune validate --dataset public`. `korthikanti22` holds
the 8 end-to-end iteration times of Korthikanti et al. 2022 Table 5 (GPT 22B-1T on A100, full vs
selective recompute + sequence parallelism); no fit ever sees them (calibration and the shipped
defaults use `public` + `small-scale`), so they are an out-of-sample check. `vtrain-multi` holds vTrain's
109 multi-node iteration times (GPT 3.6B-175B on 64-512 A100, many plans per job), converted from its
CSV by `vtrain_multi_rows`; no fit sees them either. `bridge-dense` holds Megatron-Bridge's published dense Llama-3
pre-training runs (8B / 70B / 405B on H100, B200, GB200, GB300 in FP8, MXFP8 and NVFP4, NeMo containers 25.09-26.06;
built by tests/benchmarks/bridge_dense_rows.py from the project's docs): the shared file holds the same pages' MoE
rows only, so these are held out of every fit as well.
"""
from __future__ import annotations

import csv
import functools
import io
import json
from importlib import resources
from pathlib import Path

from costmodels.specs import SpecError

#: dataset name -> file under autotune/data/
DATASETS = {"public": "public_runs.json", "small-scale": "small_scale_runs.json",
            "korthikanti22": "korthikanti22_table5.json", "vtrain-multi": "vtrain_multi_runs.json",
            "bridge-dense": "bridge_dense_runs.json"}

#: the datasets fits train on (fit_defaults, the cross-validation); the others are held out
TRAINING_DATASETS = ("public", "small-scale")

#: GPU generations for leave-one-generation-out evaluation (gpu_key -> generation)
GPU_GENERATIONS = {
    "a100-40gb": "A100", "a100-80gb": "A100",
    "h100": "H100/H200/H800", "h200": "H100/H200/H800", "h800": "H100/H200/H800",
    "b200": "B200/B300", "b300": "B200/B300",
    "gb200": "GB200/GB300", "gb300": "GB200/GB300",
}


def gpu_generation(gpu_key: str | None) -> str:
    return GPU_GENERATIONS.get(str(gpu_key), str(gpu_key))


def data_dir() -> Path:
    return Path(str(resources.files("autotune") / "data"))


def dataset_path(name: str) -> str:
    """The bundled file of a dataset name (a key of DATASETS)."""
    if name not in DATASETS:
        raise SpecError("dataset", f"unknown dataset {name!r}; choose {', '.join(DATASETS)}")
    path = data_dir() / DATASETS[name]
    if not path.is_file():
        raise SpecError("dataset", f"the bundled file {path} is missing (a broken install?)")
    return str(path)


#: the Megatron-Bridge MoE rows' recipe settings (autotune/data/README.md, "recipe_settings.json")
RECIPE_SETTINGS = "recipe_settings.json"
#: the launch scripts' settings of rows that leave them null (autotune/data/README.md, "launch_settings.json")
LAUNCH_SETTINGS = "launch_settings.json"


def _rows_of(name: str, block: str = "rows") -> dict:
    path = data_dir() / name
    if not path.is_file():
        return {}
    with open(path) as fh:
        return json.load(fh).get(block, {})


@functools.lru_cache(maxsize=1)
def recipe_settings() -> dict:
    """Row id -> the MoE communication settings of the recipe that produced that published run."""
    return _rows_of(RECIPE_SETTINGS)


@functools.lru_cache(maxsize=1)
def launch_settings() -> dict:
    """Row id -> the settings its published launch script (or its framework's defaults of the time) ran with."""
    return _rows_of(LAUNCH_SETTINGS)


@functools.lru_cache(maxsize=1)
def launch_settings_by_source() -> dict:
    """Source group -> the settings all of its runs ran with (where the source states them once for all)."""
    return _rows_of(LAUNCH_SETTINGS, "sources")


#: vTrain's multi-node measurements as released (github.com/VIA-Research/vTrain@f8dda8473a48,
#: data/ground_truth_multi.csv, MIT licence: LICENSE-vTrain.txt)
VTRAIN_MULTI_CSV = "vtrain_ground_truth_multi.csv"
_VTRAIN = ("Bang et al., 'vTrain: A Simulation Framework for Evaluating Cost-effective and Compute-optimal Large "
           "Language Model Training' (MICRO-57, 2024, arXiv:2312.12391); measured Megatron-DeepSpeed iteration "
           "times released in github.com/VIA-Research/vTrain (MIT licence)")
#: vTrain's simulator configs for these runs (config/validation/multi/*.json, all 108) give 8 GPUs per node
#: and inter_node_bandwidth 800, "Total bandwidth of inter-node communication in Gbps" (src/config.py; also
#: its default): 800 / 8 GPUs / 8 bits = 12.5 GB/s per GPU per direction
VTRAIN_MULTI_NIC_GB_PER_S = 800 / 8 / 8


def vtrain_multi_rows(csv_text: str) -> list[dict]:
    """vTrain's multi-node CSV (# GPUs, global batch, micro batch, hidden size, attention heads, # layers,
    sequence length, TP, DP, PP, iteration time in ms) as runs in the shared/validation schema. Read
    from the matching simulator configs (config/validation/multi/config_val_<P>B_<tp>_<dp>_<pp>_<mb>.json,
    the same in all 108): full recomputation (use_checkpoint), the non-interleaved 1F1B schedule, 8 GPUs
    per node. Assumed, as for the single-node rows: fp16, vocabulary 50257, ffn 4h, kv heads = heads; A100
    80GB (a 175B stage of tp 2 x pp 32 holds 2.7B parameters, ~44 GB of weights and Adam state)."""
    rows = []
    for line, rec in enumerate(csv.DictReader(io.StringIO(csv_text.lstrip("\ufeff"))), start=2):
        p_b, gpus, gbs, mbs = float(rec["Parameters (billion)"]), int(rec["# GPUs"]), int(rec["global batch"]), \
            int(rec["micro batch"])
        h, heads, layers, seq = (int(rec[k]) for k in ("hidden size", "attention heads", "# layers", "sequence length"))
        tp, dp, pp = (int(rec[k]) for k in ("tensor parallelism", "data parallelism", "pipeline parallelism"))
        t_s = float(rec["iteration time (ms)"]) / 1000.0
        config = f"config/validation/multi/config_val_{int(p_b)}B_{tp}_{dp}_{pp}_{mbs}.json"
        rows.append({
            "id": f"vtrain-multi-{line:03d}",
            "source": {"title": _VTRAIN, "group": "vTrain multi-node measurements",
                       "table": f"data/ground_truth_multi.csv line {line} (VIA-Research/vTrain@f8dda8473a48); "
                                f"simulator input {config}"},
            "confidence": "high",
            "model": {"name": f"GPT-{rec['Parameters (billion)']}B (L{layers}-h{h})", "layers": layers, "hidden": h,
                      "ffn_hidden": 4 * h, "heads": heads, "kv_heads": heads, "vocab": 50257, "seq_len": seq,
                      "num_experts": None, "top_k": None, "moe_ffn_hidden": None, "params_billion": p_b},
            "hardware": {"gpu": "A100", "num_gpus": gpus, "gpus_per_node": 8, "gpu_key": "a100-80gb",
                         "inter_node_gb_per_s": VTRAIN_MULTI_NIC_GB_PER_S,
                         "interconnect": "8 A100 per node; inter-node 800 Gb/s per node as vTrain's simulator "
                                         "config for the run states (src/config.py: total inter-node bandwidth)"},
            "plan": {"tp": tp, "pp": pp, "dp": dp, "cp": 1, "ep": None, "vpp": 1, "micro_batch": mbs,
                     "global_batch": gbs, "sequence_parallel": None, "recompute": "full (use_checkpoint=true in "
                     "the matching vTrain simulator config)", "distributed_optimizer_or_zero": None,
                     "precision": "fp16 mixed precision (inferred, as for vTrain's single-node rows)",
                     "precision_key": "fp16", "recompute_key": "full", "zero_key": None},
            "measured": {"iteration_time_s": t_s, "tokens_per_s_per_gpu": gbs * seq / (t_s * gpus)},
            "notes": "Measured on Megatron-DeepSpeed (vTrain data/README.md), iteration time from the CSV "
                     "(ms / 1000). Held out of every fit (autotune.datasets.TRAINING_DATASETS).",
            "derived_fields": ["model.vocab", "model.ffn_hidden", "model.kv_heads", "measured.tokens_per_s_per_gpu",
                               "plan.precision", "plan.recompute", "plan.vpp", "hardware.gpu_key",
                               "hardware.inter_node_gb_per_s"],
            "usable": True,
        })
    return rows


def load_dataset(name: str) -> list:
    from .validate import load_runs
    return load_runs(dataset_path(name))
