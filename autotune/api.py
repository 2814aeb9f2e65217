"""The Python API that the CLI and CI scripts call: build a problem, search, predict, validate."""
from __future__ import annotations

from dataclasses import dataclass

from costmodels.params import EfficiencyParams
from costmodels.plan import Plan, parse_plan_text
from costmodels.specs import SpecError
from search_spaces.optuna_space import GpuRange
from search_spaces.space import Problem, check_plan, complete_plan


from .measurements import load_params  # noqa: F401 (the API)
from .problem import DEFAULT_TOKENS_PER_STEP, build_problem, framework_spec, plan_from_text  # noqa: F401 (the API)
from .search import SearchResult, exhaustive, predict
from .study_spec import StudySpec


@dataclass(frozen=True, kw_only=True)
class OptunaRun:
    """How long an Optuna search runs and where its study lives (`search(..., strategy="optuna")`)."""
    n_trials: int | None = 300
    timeout_s: float | None = None
    storage_url: str | None = None
    study_name: str | None = None
    seed_best: bool = True          # start a new study from the exhaustive table's best plan


def search(problem: Problem | StudySpec, *, strategy: str = "exhaustive", top_k: int = 10,
           memory_limit_gb: float | None = None, params: EfficiencyParams | None = None,
           fixed: dict | None = None, run: OptunaRun | None = None, progress=None,
           space=None, max_legal: int | None = None) -> SearchResult:
    """The one search entry point (the CLI calls it for every strategy).

    `problem` is a Problem (one GPU count, exhaustive) or a StudySpec (the problem by names, a GPU
    count or range, objectives and sampler): `exhaustive` scores every legal plan (of every count of
    a range), `optuna` runs or resumes a study (`run`: trials, timeout, storage, study name)."""
    if strategy not in ("exhaustive", "optuna"):
        raise SpecError("strategy", f"unknown strategy {strategy!r}; choose exhaustive or optuna")
    if isinstance(problem, StudySpec):
        # Optuna (~0.3 s to import) only for the strategies that use it: not on the exhaustive path
        from .optuna_search import exhaustive_range, optuna_search
        if strategy == "optuna":
            run = run or OptunaRun()
            return optuna_search(problem, n_trials=run.n_trials, timeout_s=run.timeout_s,
                                 storage_url=run.storage_url, study_name=run.study_name, top_k=top_k,
                                 progress=progress, space=space, seed_best=run.seed_best)
        if isinstance(problem.gpu_spec(), GpuRange):
            return exhaustive_range(problem, top_k=top_k, space=space)
        spec = problem.resolved()
        problem, fixed, memory_limit_gb = spec.build_space().problem(spec.counts()[0]), spec.fixed, spec.memory_limit_gb
        params = params or spec.params()
    elif strategy == "optuna":
        raise SpecError("strategy", "an Optuna search takes a StudySpec (the problem by names, objectives, sampler)")
    return exhaustive(problem, params, top_k=top_k, memory_limit_gb=memory_limit_gb, fixed=fixed, max_legal=max_legal)


def predict_plan(problem: Problem, plan: Plan, *, memory_limit_gb: float | None = None,
                 params: EfficiencyParams | None = None) -> dict:
    return predict(problem, plan, params, memory_limit_gb)


def validate(file: str | None = None, *, dataset: str | None = None, calibration: str | None = None,
             only_usable: bool = True) -> dict:
    """Predict measured runs (a runs file, or a bundled dataset: `autotune.datasets.DATASETS`) and report
    the error per run, MAPE and max error (overall, dense/MoE, by source, by GPU generation), the
    runs predicted not to fit and the published plans outside the legal space (with the rules)."""
    from .validate import validate_runs
    return validate_runs(file, dataset=dataset, calibration=calibration, only_usable=only_usable)
