"""The Python API that the CLI and CI scripts call: build a problem, search, predict, validate."""
from __future__ import annotations

from costmodels.params import EfficiencyParams
from costmodels.plan import Plan, parse_plan_text
from costmodels.presets import build_cluster, load_model
from costmodels.specs import JobSpec, Precision, SpecError
from search_spaces.space import Problem, check_plan, complete_plan

from .search import SearchResult, exhaustive, predict

#: default tokens per optimizer step when --global-batch is omitted (Llama 3 / GPT-3 scale: ~4M)
DEFAULT_TOKENS_PER_STEP = 4 * 1024 * 1024


def build_problem(*, model: str, gpu: str | None = None, gpus: int | None = None,
                  global_batch: int | None = None, seq_len: int | None = None,
                  precision: str = "bf16", gpus_per_node: int | None = None,
                  intra_node_bw: float | None = None, inter_node_bw: float | None = None,
                  cluster_file: str | None = None) -> Problem:
    """Model preset or config.json + GPU preset (+ overrides or cluster file) + job -> Problem."""
    spec = load_model(model)
    cluster = build_cluster(gpu=gpu, num_gpus=gpus, gpus_per_node=gpus_per_node,
                            intra_node_bw_gbps=intra_node_bw, inter_node_bw_gbps=inter_node_bw,
                            cluster_file=cluster_file)
    prec = Precision.parse(precision, "precision")
    if cluster.gpu.peak_flops(prec) <= 0:
        raise SpecError("precision", f"{cluster.gpu.name} has no {prec.value} tensor cores; "
                        f"use bf16{' or fp8' if cluster.gpu.peak_flops_fp8 else ''}")
    seq = seq_len if seq_len is not None else min(spec.max_seq_len, 8192)
    if global_batch is None:
        global_batch = max(1, DEFAULT_TOKENS_PER_STEP // max(seq, 1))
    job = JobSpec(global_batch=global_batch, seq_len=seq, precision=prec)
    return Problem(spec, cluster, job)


def load_params(calibration: str | None, gpu: str | None = None) -> tuple[EfficiencyParams, str]:
    """Efficiency parameters: a calibration file if given, else the shipped defaults. With `gpu`,
    a file fitted for another GPU is refused (one-line SpecError naming the fix)."""
    from .measurements import calibration_for_gpu, read_calibration
    if not calibration:
        return EfficiencyParams(), "defaults"
    if gpu is not None:
        return calibration_for_gpu(calibration, gpu)
    return read_calibration(calibration)[0], calibration


def plan_from_text(text: str, problem: Problem) -> Plan:
    """Parse --plan, fill omitted knobs with defaults (dp from the GPU count), check legality."""
    plan = complete_plan(parse_plan_text(text), problem)
    check_plan(plan, problem)
    return plan


def search(problem: Problem, *, strategy: str = "exhaustive", top_k: int = 10,
           memory_limit_gb: float | None = None, params: EfficiencyParams | None = None,
           fixed: dict | None = None) -> SearchResult:
    if strategy != "exhaustive":
        raise SpecError("strategy", f"unknown strategy {strategy!r}; choose exhaustive")
    return exhaustive(problem, params, top_k=top_k, memory_limit_gb=memory_limit_gb, fixed=fixed)


def predict_plan(problem: Problem, plan: Plan, *, memory_limit_gb: float | None = None,
                 params: EfficiencyParams | None = None) -> dict:
    return predict(problem, plan, params, memory_limit_gb)


def validate(file: str | None = None, *, dataset: str | None = None, calibration: str | None = None,
             only_usable: bool = True) -> dict:
    """Predict measured runs (a runs file, or the bundled `public` / `small-scale` dataset) and report
    the error per run, MAPE and max error (overall, dense/MoE, by source, by GPU generation), the
    runs predicted not to fit and the published plans outside the legal space (with the rules)."""
    from .validate import validate_runs
    return validate_runs(file, dataset=dataset, calibration=calibration, only_usable=only_usable)
