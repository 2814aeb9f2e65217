"""Which plans exist: knob domains, legality rules, and enumeration straight into arrays.

One definition of each knob (`KNOBS`) and each rule (`RULES`) serves enumeration, the check of a
single user-given plan, Optuna's distributions and the report columns. Rules follow Megatron-Core's
argument checks (megatron/training/arguments.py, core/parallel_state.py): world size = tp*cp*pp*dp;
tp divides heads and KV heads; pp*vpp stages hold at least one layer each; micro-batches are whole
(1F1B accepts fewer than pp, with a larger bubble) and at least pp when interleaving (in groups of pp, or of the
smallest larger group the schedule takes); expert layers fold ep*etp into tp*cp*dp; cp splits
the sequence into 2*cp chunks for load-balanced causal attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from costmodels.plan import (DEFAULT_RECOMPUTE_MODULES, PLAN_FIELDS, RECOMPUTE_MODULES, Plan, PlanBatch, expand_layout,
                             module_bit,
                             modules_mask, modules_of_mask, parse_layout, stage_layers)
from costmodels.specs import (ClusterSpec, CudaGraphImpl, CudaGraphModule, DispatcherType, Fp8Recipe, Framework, JobSpec,
                              ModelSpec, Recompute, SpecError)

POW2 = (1, 2, 4, 8, 16, 32, 64, 128, 256)
VPP_CHOICES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
MBS_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass(frozen=True)
class Problem:
    """Everything that decides which plans are legal and how they score."""
    model: ModelSpec
    cluster: ClusterSpec
    job: JobSpec

    def __post_init__(self):
        self.job.framework.check_cuda_graphs_for(self.model)   # modules the model must have
        self.job.framework.check_mtp_for(self.model)           # MTP where the framework runs it
        self.job.framework.check_cpu_offloading_for(self.model)  # fewer offloaded layers than the model has
        self.job.check_fp8_recipe_for(self.cluster.gpu)          # an fp8 recipe the GPU runs
        self.job.framework.check_attention_backend_for(self.model)   # a kernel that runs the model's attention
        self.job.check_fp8_attention_for(self.model, self.cluster.gpu)  # fp8 attention of the model's softmax


@dataclass(frozen=True)
class Knob:
    name: str
    label: str                                   # report column header
    domain: Callable[[Problem], tuple]           # candidate values before legality
    fmt: Callable[[int], str] = str
    #: False for the knobs only the Optuna search samples: enumeration keeps them at 0 (their
    #: default) unless the user fixes them, since they would multiply the space by ~L^2
    exhaustive: bool = True


def _divisors(n: int, limit: int) -> tuple:
    return tuple(d for d in range(1, min(n, limit) + 1) if n % d == 0)


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("tp", "TP", lambda p: tuple(x for x in POW2 if x <= min(p.cluster.num_gpus, p.model.num_attention_heads, 64))),
    Knob("cp", "CP", lambda p: tuple(x for x in POW2 if x <= min(p.cluster.num_gpus, 64))),
    Knob("pp", "PP", lambda p: _divisors(p.cluster.num_gpus, p.model.num_layers)),
    Knob("dp", "DP", lambda p: _divisors(p.cluster.num_gpus, p.cluster.num_gpus)),   # derived
    Knob("ep", "EP", lambda p: tuple(x for x in POW2 if x <= min(p.model.num_experts, p.cluster.num_gpus))
         if p.model.is_moe else (1,)),
    Knob("etp", "ETP", lambda p: tuple(x for x in POW2 if x <= min(64, p.cluster.num_gpus)) if p.model.is_moe else (1,)),
    Knob("vpp", "VPP", lambda p: tuple(v for v in VPP_CHOICES if v <= p.model.num_layers)),
    Knob("mbs", "MBS", lambda p: tuple(b for b in MBS_CHOICES if b <= p.job.global_batch)),
    Knob("recompute", "Recompute", lambda p: tuple(int(r) for r in Recompute),
         lambda v: Recompute(v).name.lower()),
    Knob("recompute_modules", "Rec. modules", lambda p: recompute_module_sets(p.model),
         lambda v: "+".join(modules_of_mask(v)) or "-"),
    Knob("sp", "SP", lambda p: (0, 1), lambda v: "on" if v else "off"),
    Knob("zero", "ZeRO", lambda p: zero_stages(p.job)),
    # Megatron-Bridge sets both for Llama-3.1 405B and Qwen3 235B: the embedding / loss take a
    # layer's slot in the even split
    Knob("account_for_embedding", "Acc. emb.", lambda p: (0, 1), lambda v: "yes" if v else "no"),
    Knob("account_for_loss", "Acc. loss", lambda p: (0, 1), lambda v: "yes" if v else "no"),
    # 0 = even split / every layer; rules below bound them by the plan's stage and chunk sizes (up to L - 1: two
    # stages of 61 layers split 30 + 31). Optuna samples every value; enumeration adds only uneven_splits' balanced
    # pairs (_uneven_outer), not the whole range
    Knob("first_layers", "First", lambda p: tuple(range(0, p.model.num_layers)),
         lambda v: str(v) if v else "even", exhaustive=False),
    Knob("last_layers", "Last", lambda p: tuple(range(0, p.model.num_layers)),
         lambda v: str(v) if v else "even", exhaustive=False),
    Knob("recompute_layers", "Rec. layers", lambda p: tuple(range(0, p.model.num_layers)),
         lambda v: str(v) if v else "all", exhaustive=False),
)}
#: plan fields that are not knobs: a --pipeline-model-parallel-layout is given by the user (or a
#: published recipe), never searched; enumerated plans have none (0)
NOT_SEARCHED = ("layout",)


def recompute_module_sets(model: ModelSpec) -> tuple:
    """--recompute-modules sets the search tries with recompute=selective (0 = no set, for none and
    full): Megatron-Core's default core_attn, then cumulatively the layernorms and the activation
    functions of the MLPs the model has, then whole MLP / MoE blocks (transformer_config.py)."""
    sets = [(), ("core_attn",), ("core_attn", "layernorm")]
    act = "moe_act" if model.is_moe else "mlp"
    if model.is_moe:
        sets.append(("core_attn", "layernorm", "moe_act"))
        sets.append(("core_attn", "layernorm", "moe"))
        if model.num_shared_experts:
            sets.append(("core_attn", "layernorm", "moe", "shared_experts"))
    else:
        sets.append(("core_attn", "layernorm", act))
    if model.is_mla:
        sets.append(("core_attn", "layernorm", "mla_up_proj") + (("moe_act",) if model.is_moe else ()))
    return tuple(modules_mask(s) for s in sets)


def applicable_modules_mask(model: ModelSpec) -> int:
    """The --recompute-modules that act on this model (the others are no-ops, so illegal here)."""
    names = ["core_attn", "layernorm"]
    if model.num_layers > model.num_moe_layers:
        names.append("mlp")
    if model.is_moe:
        names += ["moe_act", "moe"] + (["shared_experts"] if model.num_shared_experts else [])
    if model.is_mla:
        names.append("mla_up_proj")
    return modules_mask(names)


def zero_stages(job: JobSpec) -> tuple:
    """Megatron-Core: plain DDP, the distributed optimizer (ZeRO-1) and FSDP (ZeRO-3); ZeRO-2 exists
    only in DeepSpeed (stage 2 reduce-scatters gradients every micro-batch)."""
    return (0, 1, 2, 3) if job.framework.framework is Framework.DEEPSPEED else (0, 1, 3)

#: the knobs only the Optuna search samples, after all the others
OPTUNA_ONLY_KNOBS = tuple(k for k, knob in KNOBS.items() if not knob.exhaustive)


@dataclass(frozen=True)
class Rule:
    name: str
    ok: Callable[[dict, Problem], np.ndarray]    # vectorized: arrays -> bool mask of legal rows
    explain: Callable[[dict, Problem], str]      # message for one plan (arrays of length 1)
    #: the rule can only fail when one of these knobs is non-zero (enumeration skips it when they
    #: are all pinned to 0)
    only_if_set: tuple = ()


def _v(a, k):
    return int(np.asarray(a[k]).reshape(-1)[0])


def _mb(a, p):
    return p.job.global_batch // (a["dp"] * a["mbs"])


def _stages(a, p):
    # a layout's ranks count its MTP layers 'm' (plan.parse_layout)
    layers = p.model.num_layers + (a["layout"] > 0) * p.model.mtp_num_layers
    return stage_layers(layers, a["pp"], a["vpp"], a["first_layers"], a["last_layers"],
                        acc_embedding=a["account_for_embedding"], acc_loss=a["account_for_loss"], layout=a["layout"])


def _uneven(a):
    """Rows with --decoder-first/last-pipeline-num-layers (not a layout)."""
    return (a["layout"] == 0) & ((a["first_layers"] > 0) | (a["last_layers"] > 0))


def _units(a, p):
    """Layers of the even split, the embedding and the loss counted when accounted for."""
    return p.model.num_layers + a["account_for_embedding"] + a["account_for_loss"]


def _even_ok(a, p):
    """Megatron-Core's even split (get_num_layers_to_build): the units divide by pp, and each rank's
    share by vpp."""
    u = _units(a, p)
    per_rank = u // np.maximum(a["pp"], 1)
    return (u % a["pp"] == 0) & (per_rank % a["vpp"] == 0) & (per_rank >= a["vpp"])


def _middle(a, p):
    """(middle stages, their layers) of an uneven split."""
    others = a["pp"] - (a["first_layers"] > 0) - (a["last_layers"] > 0)
    rest = p.model.num_layers - a["first_layers"] - a["last_layers"]
    return others, rest


def _middle_ok(a, p):
    """TransformerConfig's uneven-PP checks: middle stages exist iff middle layers do; they divide
    evenly, and each middle rank's layers by vpp."""
    others, rest = _middle(a, p)
    per = rest // np.maximum(others, 1)
    ok = np.where(others > 0, (rest > 0) & (rest % np.maximum(others, 1) == 0) & (per % a["vpp"] == 0)
                  & (per >= a["vpp"]), rest == 0)
    return ~_uneven(a) | ok


def _max_chunk(a, p):
    n_first, n_mid, n_last = _stages(a, p)
    n_mid = np.where(a["pp"] > 2, n_mid, 0)
    return np.maximum(np.maximum(n_first, n_mid), n_last) // a["vpp"]


_SELECTIVE = int(Recompute.SELECTIVE)


def _graphed(p: Problem, module: CudaGraphModule) -> bool:
    """The job's CUDA graphs capture `module`: named in --cuda-graph-modules, or a whole-layer
    (no modules) or full-iteration capture (transformer_config.py: `full_cudagraph`)."""
    fw = p.job.framework
    whole = fw.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION or (fw.cuda_graph_impl.per_layer
                                                                    and not fw.cuda_graph_modules)
    return whole or module in fw.cuda_graph_modules


def _ring_cp_refusal(p: Problem) -> str:
    """What of the model's attention Transformer Engine's ring (p2p) context parallelism refuses ("" if none) under
    Megatron-Core; a JAX trainer shards the sequence its own way."""
    if p.job.framework.framework is not Framework.MEGATRON:
        return ""
    m = p.model
    parts = [what for what, has in (("the sliding-window attention", m.num_sliding_window_layers > 0),
                                    ("the attention sinks", m.attention_sinks)) if has]
    return " and ".join(parts)


def _deepspeed(p: Problem) -> bool:
    return p.job.framework.framework is Framework.DEEPSPEED


def _jax(p: Problem) -> bool:
    return p.job.framework.framework is Framework.JAX


def deepspeed_partition(num_layers: int, pp: int) -> tuple | None:
    """(first_layers, last_layers) standing for the split DeepSpeed's PipelineModule makes itself where pp does
    not divide the layers (partition_method='type:transformer' balances them: at most ceil(L / pp) per stage),
    as `validate`'s balanced layout reads it: ceil(L / pp) on the first and middle stages, the rest on the last.
    None where pp divides them (the even split) or the rest would be empty."""
    first, last, exists = _deepspeed_sizes(num_layers, pp)
    return (int(first), int(last)) if exists else None


def _deepspeed_sizes(num_layers: int, pp):
    """deepspeed_partition's (first, last, whether it exists) for a pp or an array of them."""
    pp = np.maximum(pp, 1)
    k = -(-num_layers // pp)
    last = num_layers - (pp - 1) * k
    return k, last, (pp >= 2) & (num_layers % pp != 0) & (last >= 1)


def _is_deepspeed_partition(a, p):
    """Rows whose first / last stage sizes are deepspeed_partition's for their pp (vpp 1)."""
    first, last, exists = _deepspeed_sizes(p.model.num_layers, a["pp"])
    return exists & (a["vpp"] == 1) & (a["first_layers"] == first) & (a["last_layers"] == last)


def _recomputes(a, name: str):
    return (a["recompute"] == _SELECTIVE) & ((a["recompute_modules"] & module_bit(name)) != 0)


def _dropout_graph_ok(a, p: Problem):
    """transformer_config.py: hidden dropout draws random numbers a graphed MLP / MoE recomputation
    cannot replay."""
    if p.model.hidden_dropout == 0.0 or p.job.framework.cuda_graph_impl is CudaGraphImpl.NONE:
        return np.ones(np.shape(a["recompute"]), dtype=bool)
    return ~((_graphed(p, CudaGraphModule.MLP) & _recomputes(a, "mlp"))
             | (_graphed(p, CudaGraphModule.MOE) & _recomputes(a, "moe")))


RULES: tuple[Rule, ...] = (
    Rule("gpus", lambda a, p: a["tp"] * a["cp"] * a["pp"] * a["dp"] == p.cluster.num_gpus,
         lambda a, p: f"tp*cp*pp*dp = {_v(a,'tp')}*{_v(a,'cp')}*{_v(a,'pp')}*{_v(a,'dp')} must equal "
                      f"gpus={p.cluster.num_gpus}"),
    Rule("tp_heads", lambda a, p: (p.model.num_attention_heads % a["tp"] == 0) & (p.model.num_kv_heads % a["tp"] == 0),
         lambda a, p: f"tp={_v(a,'tp')} must divide num_attention_heads={p.model.num_attention_heads} and "
                      f"num_kv_heads={p.model.num_kv_heads}"),
    Rule("cp_seq", lambda a, p: (a["cp"] == 1) | (p.job.seq_len % (2 * a["cp"]) == 0),
         lambda a, p: f"cp={_v(a,'cp')}: seq_len={p.job.seq_len} must divide by 2*cp={2*_v(a,'cp')} "
                      f"(load-balanced causal chunks)"),
    # Megatron-Core's context parallelism is a p2p ring by default (--cp-comm-type p2p, the only kind this cost model
    # prices); Transformer Engine's attn_forward_func_with_cp asserts that sliding-window attention runs with a2a or
    # all_gather only and a softmax with sinks with a2a only (context_parallel.py, v2.9-v2.18)
    Rule("cp_ring_attention", lambda a, p: (a["cp"] == 1) | (not _ring_cp_refusal(p)),
         lambda a, p: f"cp={_v(a,'cp')}: Megatron-Core's context parallelism is a p2p ring (--cp-comm-type p2p), "
                      f"and Transformer Engine runs {_ring_cp_refusal(p)} of {p.model.name} only with cp_comm_type "
                      f"{'a2a' if p.model.attention_sinks else 'a2a or all_gather'} (context_parallel.py asserts); "
                      "use cp=1"),
    Rule("ep_experts", lambda a, p: (a["ep"] == 1) | ((p.model.num_experts > 0)
                                                     & (p.model.num_experts % np.maximum(a["ep"], 1) == 0)),
         lambda a, p: (f"ep={_v(a,'ep')} must divide the number of experts {p.model.num_experts}" if p.model.is_moe
                       else f"ep={_v(a,'ep')} needs a Mixture-of-Experts model ({p.model.name} is dense)")),
    Rule("ep_fold", lambda a, p: (a["tp"] * a["cp"] * a["dp"]) % (a["ep"] * a["etp"]) == 0,
         lambda a, p: f"ep*etp = {_v(a,'ep')*_v(a,'etp')} must divide tp*cp*dp = "
                      f"{_v(a,'tp')*_v(a,'cp')*_v(a,'dp')} (MoE parallel folding)"),
    Rule("etp_ffn", lambda a, p: (a["etp"] == 1) | ((p.model.num_experts > 0)
                                                & (max(p.model.moe_ffn_hidden_size, 1) % np.maximum(a["etp"], 1) == 0)),
         lambda a, p: (f"etp={_v(a,'etp')} must divide the expert FFN size {p.model.moe_ffn_hidden_size}"
                       if p.model.is_moe else f"etp={_v(a,'etp')} needs a Mixture-of-Experts model")),
    Rule("vpp_needs_pp", lambda a, p: (a["vpp"] == 1) | (a["pp"] >= 2),
         lambda a, p: f"vpp={_v(a,'vpp')} (interleaved schedule) needs pp >= 2"),
    # the even split (no first/last stage sizes, no layout) [Megatron-Core get_num_layers_to_build]
    Rule("pp_split", lambda a, p: _uneven(a) | (a["layout"] > 0) | _even_ok(a, p),
         lambda a, p: f"num_layers={p.model.num_layers}"
                      f"{' + embedding' if _v(a, 'account_for_embedding') else ''}"
                      f"{' + loss' if _v(a, 'account_for_loss') else ''} must split evenly over pp={_v(a,'pp')} "
                      f"ranks of vpp={_v(a,'vpp')} chunks each (Megatron-Core); try account_for_embedding/"
                      f"account_for_loss, first_layers/last_layers or a layout"),
    Rule("account_needs_pp", lambda a, p: ((a["account_for_embedding"] == 0) & (a["account_for_loss"] == 0))
         | (a["pp"] > 1),
         lambda a, p: f"account_for_embedding={_v(a, 'account_for_embedding')}/account_for_loss="
                      f"{_v(a, 'account_for_loss')} need pp >= 2, got pp={_v(a, 'pp')} (they change the pipeline split)"),
    Rule("account_not_uneven", lambda a, p: ((a["account_for_embedding"] == 0) & (a["account_for_loss"] == 0))
         | ((a["first_layers"] == 0) & (a["last_layers"] == 0) & (a["layout"] == 0)),
         lambda a, p: f"account_for_embedding={_v(a, 'account_for_embedding')}/account_for_loss="
                      f"{_v(a, 'account_for_loss')} cannot be combined with first_layers={_v(a, 'first_layers')}/"
                      f"last_layers={_v(a, 'last_layers')} or a layout (Megatron-Core TransformerConfig)"),
    # uneven pipeline stages (Megatron-Core --decoder-first/last-pipeline-num-layers)
    Rule("stage_layers_need_pp", lambda a, p: ~_uneven(a) | (a["pp"] > 1),
         lambda a, p: "first_layers/last_layers need pp >= 2 (they size the first and last pipeline stage)",
         only_if_set=('first_layers', 'last_layers')),
    Rule("stage_layers_vpp", lambda a, p: ~_uneven(a) | ((a["first_layers"] % a["vpp"] == 0)
                                                         & (a["last_layers"] % a["vpp"] == 0)),
         lambda a, p: f"first_layers={_v(a,'first_layers')} and last_layers={_v(a,'last_layers')} must be "
                      f"multiples of vpp={_v(a,'vpp')} (Megatron-Core splits each stage into vpp chunks)",
         only_if_set=('first_layers', 'last_layers')),
    Rule("stage_layers_rest", _middle_ok,
         lambda a, p: f"first_layers={_v(a,'first_layers')} + last_layers={_v(a,'last_layers')} leave "
                      f"{p.model.num_layers - _v(a,'first_layers') - _v(a,'last_layers')} of "
                      f"{p.model.num_layers} layers for {_v({'o': _middle(a, p)[0]}, 'o')} middle stages: they must "
                      f"split evenly, at least vpp={_v(a,'vpp')} per stage and a multiple of it (and nothing may "
                      f"be left over when no middle stage exists)",
         only_if_set=('first_layers', 'last_layers')),
    # Megatron-DeepSpeed (microsoft/Megatron-DeepSpeed@f4157bea): with --deepspeed a pipeline is DeepSpeed's
    # PipelineEngine (megatron/training.py train_step: model[0].train_batch), whose TrainSchedule is plain 1F1B
    Rule("deepspeed_no_interleave", lambda a, p: (not _deepspeed(p)) | (a["vpp"] == 1),
         lambda a, p: f"vpp={_v(a,'vpp')} with --framework deepspeed: Megatron-DeepSpeed runs pipelines on DeepSpeed's "
                      "PipelineEngine, whose 1F1B schedule has no interleaving; use vpp=1"),
    # its arguments.py has no --context-parallel-size (its long-sequence scheme is DeepSpeed-Ulysses,
    # --ds-sequence-parallel-size, an all-to-all over heads that this cost model does not price)
    Rule("deepspeed_no_cp", lambda a, p: (not _deepspeed(p)) | (a["cp"] == 1),
         lambda a, p: f"cp={_v(a,'cp')} with --framework deepspeed: Megatron-DeepSpeed has no context parallelism "
                      "(no --context-parallel-size; DeepSpeed-Ulysses is not modeled); use cp=1"),
    # GPTModelPipe builds PipelineModule(partition_method='type:transformer'): DeepSpeed places the layers
    # itself, with the embedding on the first stage and the loss on the last; Megatron-Core's
    # --account-for-*-in-pipeline-split and --decoder-first/last-pipeline-num-layers do not exist there
    # (a layout is never searched: `validate` gives one where L / pp is not whole, the split DeepSpeed balances).
    # Where pp does not divide the layers, the first / last stage sizes may only say how DeepSpeed balances them
    # (deepspeed_partition): no flag sets them, the engine does
    Rule("deepspeed_split", lambda a, p: (not _deepspeed(p)) | (a["layout"] > 0) | ((a["account_for_embedding"] == 0)
                                                               & (a["account_for_loss"] == 0)
                                                               & (((a["first_layers"] == 0) & (a["last_layers"] == 0))
                                                                  | _is_deepspeed_partition(a, p))),
         lambda a, p: f"account_for_embedding={_v(a,'account_for_embedding')}/account_for_loss="
                      f"{_v(a,'account_for_loss')}/first_layers={_v(a,'first_layers')}/"
                      f"last_layers={_v(a,'last_layers')} "
                      "with --framework deepspeed: DeepSpeed's PipelineModule splits the transformer layers itself "
                      "(partition_method='type:transformer'); give only pp (the even split, or DeepSpeed's "
                      "balanced one where pp does not divide the layers)"),
    # MaxText (--framework jax) splits the decoder layers evenly over its pipeline stages (one layers-per-stage
    # number, no per-stage sizes); a Megatron split has no MaxText key (export.maxtext_config refuses it too)
    Rule("jax_split", lambda a, p: (not _jax(p)) | ((a["layout"] == 0) & (a["account_for_embedding"] == 0)
                                                    & (a["account_for_loss"] == 0) & (a["first_layers"] == 0)
                                                    & (a["last_layers"] == 0)),
         lambda a, p: f"account_for_embedding={_v(a,'account_for_embedding')}/account_for_loss="
                      f"{_v(a,'account_for_loss')}/first_layers={_v(a,'first_layers')}/"
                      f"last_layers={_v(a,'last_layers')} with --framework jax: MaxText splits the decoder layers "
                      "evenly over its pipeline stages; use the even split"),
    # first of the inner rules: enumeration drops the pairs that break it before expanding
    Rule("recompute_modules_selective", lambda a, p: (a["recompute"] == _SELECTIVE) == (a["recompute_modules"] != 0),
         lambda a, p: ("recompute=selective needs recompute_modules (Megatron-Core's default: core_attn; "
                       f"{len(RECOMPUTE_MODULES)} modules known)"
                       if _v(a, "recompute") == _SELECTIVE else
                       f"recompute_modules={'+'.join(modules_of_mask(_v(a, 'recompute_modules')))} are only used with "
                       f"recompute=selective, got recompute={Recompute(_v(a, 'recompute')).name.lower()} "
                       f"(Megatron --recompute-granularity; 2 choices: selective or full)")),
    # --cpu-offloading-num-layers (transformer_config.py): "Currently there is no support for Pipeline parallelism with
    # CPU offloading" and "CPU offloading does not work when activation recomputation is enabled"
    Rule("cpu_offloading_no_pp", lambda a, p: (p.job.framework.cpu_offloading_num_layers == 0) | (a["pp"] == 1),
         lambda a, p: f"pp={_v(a,'pp')} with cpu_offloading_num_layers={p.job.framework.cpu_offloading_num_layers}: "
                      "Megatron-Core has no pipeline parallelism with CPU offloading; use pp=1"),
    Rule("cpu_offloading_no_recompute", lambda a, p: (p.job.framework.cpu_offloading_num_layers == 0)
         | (a["recompute"] == int(Recompute.NONE)),
         lambda a, p: f"recompute={Recompute(_v(a, 'recompute')).name.lower()} with cpu_offloading_num_layers="
                      f"{p.job.framework.cpu_offloading_num_layers}: Megatron-Core's CPU offloading does not work with "
                      "activation recomputation; use recompute=none"),
    Rule("batch_divisible", lambda a, p: p.job.global_batch % (a["dp"] * a["mbs"]) == 0,
         lambda a, p: f"global_batch={p.job.global_batch} must divide by dp*mbs = {_v(a,'dp')}*{_v(a,'mbs')}"),
    Rule("microbatches", lambda a, p: _mb(a, p) >= 1,
         lambda a, p: f"global_batch={p.job.global_batch} gives no whole micro-batch for dp*mbs = "
                      f"{_v(a,'dp')*_v(a,'mbs')}"),
    # 1F1B runs with fewer micro-batches than stages (a larger bubble); interleaving needs at least pp of them, in
    # groups of pp when pp divides them, else of --microbatch-group-size-per-virtual-pipeline-stage N
    # (schedules.py: N in [pp, m], m % N == 0 or >= pp; plan.microbatch_group_size, which export passes)
    Rule("interleave_microbatches", lambda a, p: (a["vpp"] == 1) | (_mb(a, p) >= a["pp"]),
         lambda a, p: f"with vpp={_v(a,'vpp')} the micro-batch count {_v({'m': _mb(a, p)}, 'm')} must be at "
                      f"least pp={_v(a,'pp')} (Megatron-Core's interleaved schedule)"),
    Rule("recompute_modules_model", lambda a, p: (a["recompute_modules"] & ~applicable_modules_mask(p.model)) == 0,
         lambda a, p: f"recompute_modules {'+'.join(modules_of_mask(_v(a, 'recompute_modules')))} include modules "
                      f"{p.model.name} does not have (it has "
                      f"{'+'.join(modules_of_mask(applicable_modules_mask(p.model)))})"),
    # Megatron-DeepSpeed's --recompute-granularity selective recomputes the core attention only (no
    # --recompute-modules); GPTModelPipe: "deepspeed's pipeline doesn't support the block recompute method"
    Rule("deepspeed_recompute", lambda a, p: (not _deepspeed(p))
         | (((a["recompute"] != _SELECTIVE) | (a["recompute_modules"] == modules_mask(("core_attn",))))
            & ((a["recompute_layers"] == 0) | (a["pp"] == 1))),
         lambda a, p: (f"recompute_modules={'+'.join(modules_of_mask(_v(a, 'recompute_modules')))} "
                       f"({len(modules_of_mask(_v(a, 'recompute_modules')))} modules) with --framework deepspeed: "
                       "Megatron-DeepSpeed's selective recompute is the core attention only (1 module: core_attn)"
                       if _v(a, "recompute") == _SELECTIVE else
                       f"recompute_layers={_v(a,'recompute_layers')} with pp={_v(a,'pp')} and --framework deepspeed: "
                       "DeepSpeed's pipeline has no block recompute (GPTModelPipe); use recompute_layers=0")),
    # transformer_config.py (core_v0.14-v0.18): "Delayed scaling does not support moe_act and layernorm recompute for
    # fp8" (Transformer Engine's delayed scaling keeps amax histories a replayed forward would update twice)
    Rule("fp8_delayed_recompute", lambda a, p: (p.job.fp8_recipe is not Fp8Recipe.DELAYED)
         | (p.job.framework.framework is not Framework.MEGATRON) | (a["recompute"] != _SELECTIVE)
         | ((a["recompute_modules"] & modules_mask(("layernorm", "moe_act"))) == 0),
         lambda a, p: f"recompute_modules {'+'.join(modules_of_mask(_v(a, 'recompute_modules')))} with fp8 delayed "
                      "scaling: Megatron-Core refuses layernorm and moe_act recompute under it; drop them, or use "
                      "--fp8-recipe tensorwise / mxfp8"),
    Rule("sp_needs_tp", lambda a, p: (a["sp"] == 0) | (a["tp"] > 1),
         lambda a, p: "sp=true needs tp > 1"),
    Rule("moe_tp_needs_sp", lambda a, p: (not p.model.is_moe) | (a["tp"] == 1) | (a["sp"] == 1),
         lambda a, p: f"MoE layers with tp={_v(a,'tp')} > 1 need sp=true (Megatron-Core rule)"),
    Rule("tp_overlap_needs_sp", lambda a, p: (not p.job.framework.tp_comm_overlap) | (a["tp"] == 1) | (a["sp"] == 1),
         lambda a, p: f"--tp-comm-overlap with tp={_v(a,'tp')} > 1 needs sp=true (Megatron-Core rule)"),
    # a sharded optimizer over one rank runs in Megatron but equals zero=0, so the space keeps one of the two; not
    # with --fp8-param-gather, which needs the distributed optimizer even there (Megatron-Bridge's Llama-3 70B LoRA
    # recipe on 8 H100 runs it at dp 1)
    Rule("zero_needs_dp", lambda a, p: (a["zero"] == 0) | (a["dp"] * a["cp"] > 1)
         | ((a["zero"] == 1) & p.job.framework.fp8_param_gather),
         lambda a, p: f"zero={_v(a,'zero')} shards over dp*cp = 1: use zero=0"),
    Rule("zero_framework", lambda a, p: np.isin(a["zero"], zero_stages(p.job)),
         lambda a, p: f"zero={_v(a,'zero')} does not exist in {p.job.framework.framework.value} (stages "
                      f"{', '.join(map(str, zero_stages(p.job)))}: 0 DDP, 1 distributed optimizer, "
                      f"{'2 ZeRO-2, ' if 2 in zero_stages(p.job) else ''}3 FSDP)"),
    # Megatron-Bridge validates LoRA / PEFT with DDP and the distributed optimizer; Megatron-FSDP with LoRA is
    # "code-supported first, not benchmark-proven" (NVIDIA-NeMo/Megatron-Bridge issue #4246, 2026): not recommended
    Rule("lora_no_fsdp", lambda a, p: (p.job.framework.lora_dim == 0) | (a["zero"] != 3),
         lambda a, p: f"zero=3 with LoRA (--lora-dim {p.job.framework.lora_dim}): Megatron-Bridge has not validated "
                      "Megatron-FSDP with PEFT (its issue #4246); use zero=1 (the adapters' optimizer states are "
                      "small anyway)"),
    # arguments.py: "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp"
    Rule("param_gather_needs_sharding", lambda a, p: (not p.job.framework.fp8_param_gather)
         | (a["zero"] == 1) | (a["zero"] == 3),
         lambda a, p: f"--fp8-param-gather with zero={_v(a,'zero')}: Megatron gathers low-precision primary weights "
                      "only with the distributed optimizer (zero=1) or FSDP (zero=3)"),
    Rule("zero23_no_pp", lambda a, p: (a["zero"] < 2) | (a["pp"] == 1),
         lambda a, p: f"zero={_v(a,'zero')} (gradient/parameter sharding) cannot be combined with pp={_v(a,'pp')} > 1"),
    # block recomputation (Megatron --recompute-method block --recompute-num-layers N)
    Rule("recompute_layers_full", lambda a, p: (a["recompute_layers"] == 0) | (a["recompute"] == int(Recompute.FULL)),
         lambda a, p: f"recompute_layers={_v(a,'recompute_layers')} needs recompute=full",
         only_if_set=('recompute_layers',)),
    Rule("recompute_layers_chunk", lambda a, p: (a["recompute_layers"] == 0) | (a["recompute_layers"] < _max_chunk(a, p)),
         lambda a, p: f"recompute_layers={_v(a,'recompute_layers')} is not below the "
                      f"{_v({'n': _max_chunk(a, p)}, 'n')} layers of the largest pipeline chunk: use 0 "
                      f"(recompute every layer)",
         only_if_set=('recompute_layers',)),
    # CUDA graphs (transformer_config.py __post_init__, "Check cuda graph scopes")
    Rule("cuda_graph_full_recompute", lambda a, p: (a["recompute"] != int(Recompute.FULL))
         | (not p.job.framework.cuda_graph_impl.per_layer),
         lambda a, p: f"recompute=full with --cuda-graph-impl {p.job.framework.cuda_graph_impl.value} "
                      f"({len(p.job.framework.cuda_graph_modules)} modules given; 0 = the whole layer): Megatron-Core "
                      "supports full recompute only with full_iteration CUDA graphs; use recompute=selective or none"),
    Rule("cuda_graph_moe_recompute", lambda a, p: ~_recomputes(a, "moe")
         | (p.job.framework.cuda_graph_impl is not CudaGraphImpl.TRANSFORMER_ENGINE)
         | (CudaGraphModule.MOE_ROUTER not in p.job.framework.cuda_graph_modules),
         lambda a, p: f"recompute_modules=moe with a moe_router CUDA graph (1 of {len(p.job.framework.cuda_graph_modules)} "
                      "--cuda-graph-modules) of --cuda-graph-impl transformer_engine: "
                      "not supported by Megatron-Core; drop moe from recompute_modules"),
    Rule("cuda_graph_dropout_recompute", _dropout_graph_ok,
         lambda a, p: f"hidden_dropout={p.model.hidden_dropout} with a graphed MLP/MoE that selective recompute "
                      "replays: not supported by Megatron-Core; drop mlp/moe from recompute_modules"),
    # the flex dispatcher (DeepEP / HybridEP) runs over the expert TP x EP group and asserts it has more than one
    # rank (token_dispatcher.py MoEFlexTokenDispatcher: "Flex token dispatcher requires TPxEP > 1", core_v0.14-v0.18)
    Rule("flex_needs_ep", lambda a, p: (p.job.framework.moe_token_dispatcher_type is not DispatcherType.FLEX)
         | (not p.model.is_moe) | (a["ep"] * a["etp"] > 1),
         lambda a, p: f"--moe-token-dispatcher-type flex with ep={_v(a,'ep')} x etp={_v(a,'etp')} = 1: Megatron-Core's "
                      "flex dispatcher needs an expert group of more than one rank; use ep > 1 or the alltoall dispatcher"),
    # batch-level EP overlap (transformer_config.py __post_init__: overlap_moe_expert_parallel_comm)
    Rule("ep_overlap_needs_ep", lambda a, p: (not p.job.framework.overlap_moe_expert_parallel_comm) | (a["ep"] > 1),
         lambda a, p: f"--overlap-moe-expert-parallel-comm with ep={_v(a,'ep')}: it overlaps expert-parallel "
                      "all-to-alls and needs ep > 1 (Megatron-Core rule)"),
    Rule("ep_overlap_pp_needs_vpp", lambda a, p: (not p.job.framework.overlap_moe_expert_parallel_comm)
         | (a["pp"] == 1) | (a["vpp"] > 1),
         lambda a, p: f"--overlap-moe-expert-parallel-comm with pp={_v(a,'pp')} > 1 needs virtual pipeline stages "
                      "(vpp > 1; Megatron-Core rule)"),
    Rule("ep_overlap_recompute", lambda a, p: (not p.job.framework.overlap_moe_expert_parallel_comm)
         | ((a["recompute"] != int(Recompute.FULL)) & ~_recomputes(a, "moe")),
         lambda a, p: f"--overlap-moe-expert-parallel-comm with recompute={Recompute(_v(a,'recompute')).name.lower()} "
                      f"(full, or selective with moe among {_v(a,'recompute_modules')} recompute_modules bits): not "
                      "supported by Megatron-Core; use recompute=none or selective without moe"),
)


#: rules that read only the mesh knobs (tp, cp, pp, dp, ep, etp); they come first in RULES, so
#: enumeration can apply them to the small outer grid before expanding the inner knobs
MESH_RULES = ("gpus", "tp_heads", "cp_seq", "cp_ring_attention", "ep_experts", "ep_fold", "etp_ffn", "vpp_needs_pp", "pp_split",
              "account_needs_pp", "account_not_uneven", "stage_layers_need_pp", "stage_layers_vpp",
              "stage_layers_rest", "deepspeed_no_interleave", "deepspeed_no_cp", "deepspeed_split", "jax_split")
assert tuple(r.name for r in RULES[:len(MESH_RULES)]) == MESH_RULES


def check_rows(arrays: dict, problem: Problem, rules: tuple = RULES,
               multiplicity: int = 1) -> tuple[np.ndarray, dict]:
    """Legal mask and, for illegal rows, the first rule each breaks (counted by rule name, each
    row standing for `multiplicity` plans)."""
    n = len(arrays["tp"])
    legal = np.ones(n, dtype=bool)
    counts: dict = {}
    for rule in rules:
        ok = np.broadcast_to(np.asarray(rule.ok(arrays, problem), dtype=bool), (n,))
        newly_bad = legal & ~ok
        c = int(newly_bad.sum()) * multiplicity
        if c:
            counts[rule.name] = counts.get(rule.name, 0) + c
        legal &= ok
    return legal, counts


def check_plan(plan: Plan, problem: Problem) -> None:
    """Raise SpecError naming the first rule a single plan breaks (a layout is checked against
    Megatron-Core's layout rules first)."""
    if plan.layout:
        if plan.first_layers or plan.last_layers:
            raise SpecError("plan (layout)", "a layout cannot be combined with first_layers/last_layers")
        split = parse_layout(plan.layout, plan.pp, problem.model.num_layers, problem.model.mtp_num_layers)
        if split.vpp != plan.vpp:
            raise SpecError("plan (layout)", f"the layout has {split.vpp} virtual stages per rank "
                            f"({split.vpp * plan.pp} stages over pp={plan.pp}) but vpp={plan.vpp}")
    batch = PlanBatch.from_plans([plan])
    arrays = {f: np.asarray(batch[f], dtype=np.int64) for f in PLAN_FIELDS}
    for rule in RULES:
        if not bool(np.asarray(rule.ok(arrays, problem)).reshape(-1)[0]):
            raise SpecError(f"plan ({rule.name})", rule.explain(arrays, problem))


def legal_values_of(knob: str, plan: dict, problem: Problem, values) -> np.ndarray:
    """The `values` of `knob` that keep `plan` (every PLAN_FIELDS entry, as ints) legal: all rules
    checked on the candidates at once."""
    vals = np.asarray(values, dtype=np.int64)
    arrays = {f: np.full(len(vals), int(plan.get(f, 0)), dtype=np.int64) for f in PLAN_FIELDS}
    arrays[knob] = vals
    legal, _ = check_rows(arrays, problem)
    return vals[legal]


def complete_plan(values: dict, problem: Problem) -> Plan:
    """A Plan from user-given knobs; dp is derived from the GPU count when omitted."""
    v = dict(values)
    Plan(**v)                      # each given knob checked (tp=0, pp=-1) before the arithmetic below
    if "dp" not in v:
        denom = v.get("tp", 1) * v.get("cp", 1) * v.get("pp", 1)
        if problem.cluster.num_gpus % denom:
            raise SpecError("plan (gpus)", f"tp*cp*pp = {denom} does not divide gpus={problem.cluster.num_gpus}")
        v["dp"] = problem.cluster.num_gpus // denom
    if problem.model.is_moe and "sp" not in v and v.get("tp", 1) > 1:
        v["sp"] = True
    if problem.job.framework.tp_comm_overlap and "sp" not in v and v.get("tp", 1) > 1:
        v["sp"] = True
    if v.get("recompute") is Recompute.SELECTIVE and not v.get("recompute_modules"):
        v["recompute_modules"] = DEFAULT_RECOMPUTE_MODULES
    if "layout" in v and "vpp" not in v:
        v["vpp"] = max(1, len(expand_layout(v["layout"])) // max(v.get("pp", 1), 1))
    if _deepspeed(problem) and not (v.get("layout") or v.get("first_layers") or v.get("last_layers")) \
            and v.get("vpp", 1) == 1:
        # Megatron-DeepSpeed's pp alone: where it does not divide the layers, the engine's own balanced split
        part = deepspeed_partition(problem.model.num_layers, v.get("pp", 1))
        if part:
            v["first_layers"], v["last_layers"] = part
    return Plan(**v)


# ------------------------------- enumeration -------------------------------

@dataclass
class SpaceStats:
    total: int = 0          # raw combinations of the knob domains (dp derived)
    legal: int = 0
    illegal: dict = None    # rule name -> count

    def as_dict(self) -> dict:
        return {"total": self.total, "legal": self.legal, "illegal": dict(sorted((self.illegal or {}).items()))}


def domains(problem: Problem, fixed: dict | None = None, optuna_only: bool = False) -> dict:
    """Candidate values per knob (dp excluded: it is derived). `fixed` pins knobs to one value.
    The Optuna-only knobs have their whole domain with `optuna_only`, else just 0 (their default)."""
    fixed = fixed or {}
    out = {}
    for name, knob in KNOBS.items():
        if name == "dp":
            continue
        if name in fixed:
            out[name] = (int(fixed[name]),)
        elif knob.exhaustive or optuna_only:
            out[name] = tuple(int(x) for x in knob.domain(problem))
        else:
            out[name] = (0,)
    return out


def _grid(values: dict) -> dict:
    names = list(values)
    mesh = np.meshgrid(*[np.asarray(values[k], dtype=np.int64) for k in names], indexing="ij")
    return {k: m.reshape(-1) for k, m in zip(names, mesh)}


#: knobs of the outer grid of enumeration: the device mesh and the pipeline split; the rules that
#: read only these (MESH_RULES) run on it before the inner knobs are expanded
OUTER_KEYS = ("tp", "cp", "pp", "ep", "etp", "vpp", "account_for_embedding", "account_for_loss",
              "first_layers", "last_layers", "layout")


#: at most this many (first_layers, last_layers) pairs per (pp, vpp) in the exhaustive search
UNEVEN_PAIRS_MAX = 4


def uneven_splits(num_layers: int, pp: int, vpp: int) -> tuple:
    """The (first_layers, last_layers) pairs the exhaustive search tries for pp ranks of vpp chunks each
    (Megatron-Core --decoder-first/last-pipeline-num-layers): the middle ranks take k layers, ceil(L / pp)
    rounded up to a multiple of vpp, and the first and last ranks share the rest, each a multiple of vpp
    between vpp and k. That is how a layer count pp does not divide gets pipelined (DeepSeek-V3's 61 layers
    on 16 ranks: 4 + 14 x 4 + 1, Megatron-Bridge's DeepSeek-V3 recipe of 26.02): without these the search
    saw no pipeline for it at all. The even split itself is not repeated. Both extremes (the lightest first
    rank, holding the embedding, and the lightest last rank, holding the loss and any MTP layers) and the
    most balanced pairs, UNEVEN_PAIRS_MAX at most; the Optuna search tries every value."""
    if pp < 2 or vpp < 1:
        return ()
    k = -(-num_layers // (pp * vpp)) * vpp
    rest = num_layers - (pp - 2) * k
    if pp > 2 and k < vpp:
        return ()
    firsts = [f for f in range(max(vpp, rest - k), min(k, rest - vpp) + 1)
              if f % vpp == 0 and (rest - f) % vpp == 0 and not (f == k and rest - f == k)]
    if len(firsts) > UNEVEN_PAIRS_MAX:
        middle = sorted(firsts[1:-1], key=lambda f: (abs(2 * f - rest), f))[:UNEVEN_PAIRS_MAX - 2]
        firsts = sorted({firsts[0], firsts[-1], *middle})
    return tuple((f, rest - f) for f in firsts)


def _uneven_outer(problem: Problem, dom: dict) -> dict | None:
    """Outer-grid rows with uneven pipeline stages (`uneven_splits`) for every pp and vpp of the domains, when
    the caller fixed neither stage size, nor a layout, nor the embedding / loss accounting, and the framework
    has the flags (MaxText splits evenly); for Megatron-DeepSpeed the one split its engine makes itself
    (deepspeed_partition)."""
    if (_jax(problem) or dom["first_layers"] != (0,) or dom["last_layers"] != (0,) or dom["layout"] != (0,)
            or 0 not in dom["account_for_embedding"] or 0 not in dom["account_for_loss"]):
        return None
    L = problem.model.num_layers
    if _deepspeed(problem):
        # DeepSpeed balances the layers itself: one split per pp, which no flag sets
        parts = {int(pp): deepspeed_partition(L, int(pp)) for pp in dom["pp"]} if 1 in dom["vpp"] else {}
        split = [(pp, 1, *part) for pp, part in parts.items() if part]
    else:
        split = [(pp, v, f, l) for pp in dom["pp"] for v in dom["vpp"] for f, l in uneven_splits(L, int(pp), int(v))]
    if not split:
        return None
    cols = np.asarray(split, dtype=np.int64).T
    group = {"pp": cols[0], "vpp": cols[1], "first_layers": cols[2], "last_layers": cols[3]}
    zeros = {k: np.zeros(1, dtype=np.int64) for k in ("account_for_embedding", "account_for_loss", "layout")}
    return _product([{k: np.asarray(dom[k], dtype=np.int64)} for k in ("tp", "cp", "ep", "etp")] + [group]
                    + [{k: v} for k, v in zeros.items()])


def _recompute_pairs(dom: dict) -> dict:
    """The (recompute, recompute_modules) pairs that can be legal: modules only with selective."""
    rec = np.repeat(np.asarray(dom["recompute"], dtype=np.int64), len(dom["recompute_modules"]))
    mods = np.tile(np.asarray(dom["recompute_modules"], dtype=np.int64), len(dom["recompute"]))
    ok = (rec == _SELECTIVE) == (mods != 0)
    return {"recompute": rec[ok], "recompute_modules": mods[ok]}, int((~ok).sum())


def _product(parts: list[dict]) -> dict:
    """Cartesian product of groups of parallel arrays (each group a dict of equal-length arrays)."""
    sizes = [len(next(iter(g.values()))) for g in parts]
    idx = np.meshgrid(*[np.arange(n) for n in sizes], indexing="ij")
    out = {}
    for g, i in zip(parts, idx):
        for k, v in g.items():
            out[k] = np.asarray(v)[i.reshape(-1)]
    return out


def enumerate_legal(problem: Problem, fixed: dict | None = None,
                    chunk_rows: int = 1 << 20) -> tuple[Iterator[PlanBatch], SpaceStats]:
    """Legal plans as a stream of PlanBatch chunks, and the space statistics (filled while streaming).

    The grid is split into an outer part (OUTER_KEYS: mesh and pipeline split) and an inner part
    (mbs, recompute with its modules, sp, zero, block recompute); rules run as numpy masks over whole
    blocks, never per plan. (recompute, recompute_modules) pairs other than selective-with-modules
    and none/full-without are dropped up front (counted under recompute_modules_selective).
    """
    fixed = dict(fixed or {})
    layouts: tuple = ()
    if fixed.get("layout"):
        # a given --pipeline-model-parallel-layout: pp is fixed, first/last ranks' layers follow
        layout = str(fixed.pop("layout"))
        if "pp" not in fixed:
            raise SpecError("plan.layout", "a layout needs a fixed pp")
        split = parse_layout(layout, int(fixed["pp"]), problem.model.num_layers, problem.model.mtp_num_layers)
        fixed.update(first_layers=split.first, last_layers=split.last, vpp=split.vpp)
        layouts = (layout,)
    dom = domains(problem, fixed)
    dom["layout"] = (1,) if layouts else (0,)
    N = problem.cluster.num_gpus
    stats = SpaceStats(illegal={})
    pairs, n_bad_pairs = _recompute_pairs(dom)
    inner_singles = [{k: np.asarray(dom[k], dtype=np.int64)} for k in ("mbs", "sp", "zero", "recompute_layers")]
    inner = _product([pairs] + inner_singles)
    n_inner = len(inner["mbs"])
    n_inner_raw = n_inner + n_bad_pairs * int(np.prod([len(g[next(iter(g))]) for g in inner_singles]))
    outer = _product([{k: np.asarray(dom[k], dtype=np.int64)} for k in OUTER_KEYS])
    uneven = _uneven_outer(problem, dom)
    if uneven is not None:
        outer = {k: np.concatenate([v, uneven[k]]) for k, v in outer.items()}
    n_outer = len(outer["tp"])
    stats.total = n_outer * n_inner_raw
    # dp derived from the GPU count; a mesh whose tp*cp*pp does not divide it is illegal ("gpus")
    prod = outer["tp"] * outer["cp"] * outer["pp"]
    outer["dp"] = np.where(N % prod == 0, N // np.maximum(prod, 1), 0)
    if "dp" in fixed:
        outer["dp"] = np.where(outer["dp"] == int(fixed["dp"]), outer["dp"], 0)
    mesh_ok, mesh_counts = check_rows(outer, problem, RULES[:len(MESH_RULES)], n_inner_raw)
    for k, c in mesh_counts.items():
        stats.illegal[k] = stats.illegal.get(k, 0) + c
    keep = {k: v[mesh_ok] for k, v in outer.items()}
    if n_inner_raw > n_inner and mesh_ok.any():
        stats.illegal["recompute_modules_selective"] = int(mesh_ok.sum()) * (n_inner_raw - n_inner)
    # rules that cannot fail while the knobs they guard are pinned to 0 are skipped
    inner_rules = tuple(r for r in RULES[len(MESH_RULES):]
                        if not r.only_if_set or any(dom[k] != (0,) for k in r.only_if_set))

    def stream() -> Iterator[PlanBatch]:
        n_keep = len(keep["tp"])
        per_block = max(1, chunk_rows // max(n_inner, 1))
        for start in range(0, n_keep, per_block):
            sl = slice(start, min(start + per_block, n_keep))
            nb = sl.stop - sl.start
            arrays = {k: np.repeat(v[sl], n_inner) for k, v in keep.items()}
            arrays.update({k: np.tile(v, nb) for k, v in inner.items()})
            legal, counts = check_rows(arrays, problem, inner_rules)
            for k, c in counts.items():
                stats.illegal[k] = stats.illegal.get(k, 0) + c
            n_legal = int(legal.sum())
            stats.legal += n_legal
            if n_legal:
                yield PlanBatch({f: arrays[f][legal].astype(np.int32) for f in PLAN_FIELDS}, layouts)

    return stream(), stats


def count_legal(problem: Problem, fixed: dict | None = None) -> SpaceStats:
    it, stats = enumerate_legal(problem, fixed)
    for _ in it:
        pass
    return stats


def binding_rules(problem: Problem, fixed: dict | None = None, max_rows: int = 1 << 18) -> list:
    """Why a space is empty: each rule's share of combinations it rejects on its own, highest first,
    with the message for one rejected combination: [(rule, fraction, message)]. Estimated on up to
    `max_rows` combinations drawn uniformly from the product of the knob domains."""
    dom = domains(problem, fixed)
    dom["layout"] = (0,)
    sizes = {k: len(v) for k, v in dom.items()}
    n_total = int(np.prod([float(n) for n in sizes.values()]))
    if n_total <= max_rows:
        grid = _product([{k: np.asarray(v, dtype=np.int64)} for k, v in dom.items()])
    else:
        rng = np.random.default_rng(0)
        grid = {k: np.asarray(v, dtype=np.int64)[rng.integers(0, len(v), size=max_rows)] for k, v in dom.items()}
    n = len(grid["tp"])
    N = problem.cluster.num_gpus
    prod = grid["tp"] * grid["cp"] * grid["pp"]
    grid["dp"] = np.where(N % prod == 0, N // np.maximum(prod, 1), 0)
    if fixed and "dp" in fixed:
        grid["dp"] = np.where(grid["dp"] == int(fixed["dp"]), grid["dp"], 0)
    out = []
    for rule in RULES:
        with np.errstate(divide="ignore", invalid="ignore"):
            ok = np.broadcast_to(np.asarray(rule.ok({**grid, "dp": np.maximum(grid["dp"], 1)}, problem), bool), (n,))
        if rule.name == "gpus":
            ok = grid["dp"] > 0
        bad = np.flatnonzero(~ok)
        if len(bad):
            example = {k: v[bad[:1]] for k, v in grid.items()}
            # a dp no combination reaches reads as the one the caller fixed (else 1), never as 0
            example["dp"] = np.where(example["dp"] > 0, example["dp"], int(fixed["dp"]) if fixed and "dp" in fixed else 1)
            out.append((rule.name, len(bad) / n, rule.explain(example, problem)))
    return sorted(out, key=lambda r: -r[1])
