"""What a study searches, stored in the study itself (user attribute "autotune") so that a worker
needs only the storage URL and the study name."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from costmodels.params import EfficiencyParams
from costmodels.specs import SpecError
from search_spaces.optuna_space import GpuRange, PlanSpace, parse_gpus
from search_spaces.space import Problem

from .objectives import parse_objectives
from .measurements import load_params
from .problem import build_problem
from .sampler_names import DEFAULT_SAMPLER, check_sampler
from .scoring import SMALL_CHUNK

DEFAULT_BATCH = 8
MAX_BATCH = SMALL_CHUNK
PROBLEM_KEYS = ("model", "gpu", "gpus", "global_batch", "seq_len", "precision", "gpus_per_node", "intra_node_bw",
                "inter_node_bw", "cluster_file", "memory_limit_gb", "calibration", "fixed", "framework")

SPEC_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StudySpec:
    """The problem and settings of a study, as JSON-able values (`autotune.api.build_problem`'s
    arguments; `gpus` is a count or a range text). A config.json model is stored as its absolute
    path: workers on other machines need the file at the same path."""
    model: str
    gpu: str | None = None
    gpus: str | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    precision: str = "bf16"
    gpus_per_node: int | None = None
    intra_node_bw: float | None = None
    inter_node_bw: float | None = None
    cluster_file: str | None = None
    memory_limit_gb: float | None = None
    calibration: str | None = None
    fixed: dict = field(default_factory=dict)
    framework: dict = field(default_factory=dict)      # Megatron-Core options (FrameworkSpec fields)
    objectives: tuple = ("tokens_per_s",)
    sampler: str = DEFAULT_SAMPLER
    seed: int | None = None
    batch_size: int = DEFAULT_BATCH

    # ---- problem(s) ----
    def _build(self, n: int | None) -> Problem:
        return build_problem(model=self.model, gpu=self.gpu, gpus=n, global_batch=self.global_batch,
                             seq_len=self.seq_len, precision=self.precision, gpus_per_node=self.gpus_per_node,
                             intra_node_bw=self.intra_node_bw, inter_node_bw=self.inter_node_bw,
                             cluster_file=self.cluster_file, framework=self.framework)

    def gpu_spec(self) -> int | GpuRange | None:
        return None if self.gpus is None else parse_gpus(self.gpus)

    def counts(self) -> tuple[int, ...]:
        g = self.gpu_spec()
        if isinstance(g, GpuRange):
            return g.counts(self._node_size())
        return (self._build(g).cluster.num_gpus,)

    def _node_size(self) -> int:
        """GPUs per node (NVLink domain): --gpus-per-node, else the cluster file's, else the GPU preset's."""
        if self.gpus_per_node is not None:
            return int(self.gpus_per_node)
        from costmodels.presets import build_cluster, load_gpu
        if self.cluster_file is None:
            return load_gpu(self.gpu).gpus_per_node if self.gpu else 8
        try:
            return build_cluster(gpu=self.gpu, num_gpus=1 << 20, cluster_file=self.cluster_file).nvlink_domain_size
        except SpecError:
            return load_gpu(self.gpu).gpus_per_node if self.gpu else 8

    def resolved(self) -> "StudySpec":
        """The same spec with defaults made explicit (batch, sequence, model path), checked."""
        self.check()
        counts = self.counts()
        first = self._build(counts[0])
        model = self.model
        path = Path(model).expanduser()
        if path.exists():
            model = str(path.resolve())
        return replace(self, model=model, global_batch=first.job.global_batch, seq_len=first.job.seq_len,
                       objectives=parse_objectives(self.objectives),
                       sampler=check_sampler(self.sampler, len(self.objectives)))

    def check(self) -> None:
        parse_objectives(self.objectives)
        check_sampler(self.sampler, len(self.objectives))
        if not isinstance(self.batch_size, int) or not 1 <= self.batch_size <= MAX_BATCH:
            raise SpecError("batch_size", f"must be an integer in 1..{MAX_BATCH}, got {self.batch_size!r}")
        if self.memory_limit_gb is not None and not self.memory_limit_gb > 0:
            raise SpecError("memory_limit_gb", f"must be a positive number of GB, got {self.memory_limit_gb!r}")
        if self.gpus is not None:
            parse_gpus(self.gpus)

    def build_space(self) -> PlanSpace:
        counts = self.counts()
        if len(counts) == 1:
            return PlanSpace.single(self._build(counts[0]), self.fixed)
        return PlanSpace(problem_for=self._build, counts=counts, fixed=dict(self.fixed))

    def params(self) -> EfficiencyParams:
        return load_params(self.calibration)[0]

    # ---- storage ----
    def to_attrs(self) -> dict:
        d = asdict(self)
        d["objectives"] = list(self.objectives)
        return {"version": SPEC_VERSION, **d}

    def problem_attrs(self) -> dict:
        d = self.to_attrs()
        return {k: d[k] for k in PROBLEM_KEYS}

    @classmethod
    def from_attrs(cls, d: dict) -> "StudySpec":
        if not isinstance(d, dict) or "model" not in d:
            raise SpecError("study", "the study holds no autotune problem in its user attributes "
                            "(create it with `autotune search --strategy optuna --storage ... --study ...`)")
        keys = {f for f in cls.__dataclass_fields__}
        vals = {k: v for k, v in d.items() if k in keys}
        vals["objectives"] = tuple(vals.get("objectives") or ("tokens_per_s",))
        vals["fixed"] = dict(vals.get("fixed") or {})
        return cls(**vals)


def default_study_name(spec: StudySpec) -> str:
    model = Path(spec.model).parent.name if spec.model.endswith("config.json") else Path(spec.model).stem
    base = f"{model}-{spec.gpu or 'cluster'}-{spec.gpus}-{'-'.join(spec.objectives)}"
    return re.sub(r"[^A-Za-z0-9.:+-]+", "-", base).strip("-").lower()


def spec_line(spec: StudySpec) -> str:
    return f"{spec.model} on {spec.gpus} x {spec.gpu}, objectives {', '.join(spec.objectives)}"
