"""Predict published, measured training runs and report the error.

A row of `public_runs.json` (schema in shared/validation/README.md) becomes a problem and a
partially known plan. Knobs the source does not give (micro-batch, virtual stages, recomputation,
sequence parallelism, ZeRO stage, expert-TP) are filled the way the README asks: the tool reports
the best plan over the unknown knobs among those that fit, i.e. what a competent engineer running
that framework would have picked, and says which knobs it filled.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass

import numpy as np

from costmodels.encode import encode_job, encode_model
from costmodels.flops import full_attention_extra_per_token
from costmodels.params import EfficiencyParams
from costmodels.plan import RECOMPUTE_MODULES, balanced_layout, expand_layout, modules_mask
from costmodels.presets import BW_RANGE_GBPS, GPU_PRESETS, MODEL_PRESETS, build_cluster
from costmodels.specs import (DEFAULT_LORA_MODULES, AttentionBackend, CrossEntropyImpl, CudaGraphImpl, DispatcherType,
                              Fp8Recipe, Framework, FrameworkSpec, JobSpec, LoraModule, ModelSpec, Precision, Recompute,
                              SpecError, parse_cuda_graph_modules, parse_lora_modules)
from search_spaces.space import Problem, applicable_modules_mask, binding_rules

from .datasets import gpu_generation, launch_settings, launch_settings_by_source, recipe_settings
from .export import BRIDGE_FP8_PRESETS
from .problem import framework_spec, with_mtp_layers
from .files import read_json
from .search import NothingFits, NoLegalPlan, exhaustive

# Facts of model families, by name, for fields a source leaves out: whether the MLP is gated
# (SwiGLU: 3 matrices; embeddings then untied) and the tokenizer's (padded) vocabulary.
_FAMILIES = (
    (re.compile(r"nemotron", re.I), {"gated": False, "vocab": 256000}),    # squared-ReLU, 256k SentencePiece
    (re.compile(r"llama[ -_]?3", re.I), {"gated": True, "vocab": 128256}),
    (re.compile(r"llama", re.I), {"gated": True, "vocab": 32000}),
    (re.compile(r"mistral|mixtral", re.I), {"gated": True, "vocab": 32000}),
    (re.compile(r"qwen", re.I), {"gated": True, "vocab": 151936}),
    (re.compile(r"deepseek", re.I), {"gated": True, "vocab": 129280}),
    (re.compile(r"gpt[-_ ]?oss", re.I), {"gated": True, "vocab": 201088}),
    (re.compile(r"gpt|bloom|opt", re.I), {"gated": False, "vocab": 51200}),  # GPT-2 BPE padded to 128*k
)


def _family(name: str) -> dict:
    for pattern, facts in _FAMILIES:
        if pattern.search(name):
            return facts
    return {"gated": False, "vocab": 51200}


def _family_gated(name: str) -> bool:
    return _family(name)["gated"]


#: row `model` keys -> ModelSpec fields, the dimensions a preset must agree with to fill a row's gaps
_ROW_DIMS = (("layers", "num_layers"), ("hidden", "hidden_size"), ("heads", "num_attention_heads"),
             ("kv_heads", "num_kv_heads"), ("ffn_hidden", "ffn_hidden_size"), ("vocab", "vocab_size"),
             ("num_experts", "num_experts"), ("top_k", "experts_per_token"),
             ("moe_ffn_hidden", "moe_ffn_hidden_size"))


def _matching_preset(m: dict) -> ModelSpec | None:
    """The first preset that agrees with every dimension the row gives (layers, hidden size, heads,
    KV heads, FFN, vocab, experts; no expert count means dense). A preset that contradicts any given
    field is another model: a row with 96 layers, hidden 12288 and 128 heads is not GPT-3 175B (96
    heads) and must not inherit its 96 KV heads."""
    for spec in MODEL_PRESETS.values():
        if spec.num_experts != (m.get("num_experts") or 0):
            continue
        if all(m.get(key) is None or m.get(key) == getattr(spec, attr) for key, attr in _ROW_DIMS):
            return spec
    return None


def model_from_row(m: dict) -> ModelSpec:
    """A ModelSpec from a row's `model` block. The row's fields always win; the fields it omits come
    from a preset that agrees with everything the row gives, else from the family's defaults (MHA:
    KV heads = heads; 4h MLP; the family's gating and vocabulary)."""
    for key in ("layers", "hidden", "heads"):
        if m.get(key) is None:
            raise SpecError(f"model.{key}", "not given by the source")
    preset = _matching_preset(m)
    name = m.get("name") or "model"
    gated = preset.gated_mlp if preset else _family_gated(name)
    h = int(m["hidden"])
    base = dict(
        name=name, num_layers=int(m["layers"]), hidden_size=h,
        num_attention_heads=int(m["heads"]),
        ffn_hidden_size=int(m.get("ffn_hidden") or (preset.ffn_hidden_size if preset else 4 * h)),
        num_kv_heads=int(m.get("kv_heads") or (preset.num_kv_heads if preset else m["heads"])),
        vocab_size=int(m.get("vocab") or (preset.vocab_size if preset else _family(name)["vocab"])),
        gated_mlp=gated,
        tied_embeddings=(bool(m["tied_embeddings"]) if m.get("tied_embeddings") is not None
                         else preset.tied_embeddings if preset else not gated),
        max_seq_len=int(m.get("seq_len") or 4096),
    )
    if preset is not None:
        if preset.head_dim:
            base["head_dim"] = preset.head_dim
        for f in ("num_experts", "experts_per_token", "moe_ffn_hidden_size", "num_shared_experts",
                  "shared_expert_ffn_hidden_size", "first_k_dense_layers", "moe_layer_freq",
                  "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "sliding_window", "sliding_window_layers", "position_embedding", "mtp_num_layers",
                  "expert_bias", "attention_sinks", "glu_activation", "activation_clamp", "glu_linear_offset"):
            base[f] = getattr(preset, f)
        if preset.is_mla:
            base["num_kv_heads"] = base["num_attention_heads"]
    elif m.get("num_experts"):
        base.update(num_experts=int(m["num_experts"]), experts_per_token=int(m.get("top_k") or 2),
                    moe_ffn_hidden_size=int(m.get("moe_ffn_hidden") or base["ffn_hidden_size"]))
    # multi-token prediction: as the row says, else as its preset's config (DeepSeek-V3: 1, which Megatron-Bridge's
    # DeepSeek-V3 runs count in their published FLOPs, and Megatron-LM's MoE recipes set)
    spec = ModelSpec(**base)
    return spec if m.get("mtp_num_layers") is None else with_mtp_layers(spec, m["mtp_num_layers"],
                                                                         "model.mtp_num_layers")


_KNOWN_PLAN = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "vpp": "vpp", "mbs": "micro_batch"}


@dataclass
class RowCase:
    id: str
    problem: Problem
    fixed: dict
    filled: list
    measured_tokens_per_s_per_gpu: float | None
    measured_why: str | None = None      # why there is no measured throughput (validate's skip reason)


def source_of(row: dict) -> dict:
    """A row's `source` object; a bare string is read as its title (anything else as no source), so that a
    hand-written runs file never fails on it."""
    src = row.get("source")
    if isinstance(src, str):
        return {"title": src}
    return src if isinstance(src, dict) else {}


_NEMO = re.compile(r"\bnemo\b")      # the word: "Nemotron-4 ... Technical Report" is a research run, not a recipe


def is_nemo_recipe(row: dict) -> bool:
    """A run of NVIDIA's NeMo / Megatron-Bridge benchmark recipes (their published performance tables)."""
    src = source_of(row)
    text = f"{src.get('title', '')} {src.get('url', '')}".lower()
    return bool(_NEMO.search(text)) or "megatron-bridge" in text



def is_bridge_recipe(row: dict) -> bool:
    """A run of Megatron-Bridge's performance scripts: its GPTModelProvider turns
    cross_entropy_loss_fusion on and scripts/performance/utils (helpers.py, later overrides.py) set
    cross_entropy_fusion_impl="te" for every recipe (read at v0.2.0 and v0.4.0-v0.6.0)."""
    src = source_of(row)
    return "megatron-bridge" in f"{src.get('title', '')} {src.get('url', '')}".lower()


def _fp8_param_recipe(row: dict) -> bool:
    """Whether a NeMo / Megatron-Bridge recipe's fp8 run kept fp8 primary weights. Megatron-Bridge: what the
    mixed-precision preset of its recipe sets, which Bridge applies over the model config at runtime
    (export.BRIDGE_FP8_PRESETS, the table the Bridge export uses: delayed, current scaling and MXFP8 keep them,
    subchannel / block scaling does not); where a row's recipe reading records the run's own value (the dense rows:
    fp8_param_gather, and fp4_param_gather for NVFP4, which Bridge's nvfp4 preset sets from v0.4.0), that value.
    NeMo's own pages: "mx" or "delayed" in the label."""
    rec = _recipe(row)
    if str((row.get("plan") or {}).get("precision_key") or "").lower() == "fp4":
        return bool((rec.get("extras") or {}).get("fp4_param_gather"))
    if rec.get("fp8_param_gather") is not None:
        return bool(rec["fp8_param_gather"])
    if is_bridge_recipe(row):
        return BRIDGE_FP8_PRESETS[fp8_recipe_of(row)][1]
    prec = str((row.get("plan") or {}).get("precision") or "").lower()
    return "mx" in prec or "delayed" in prec


def fp8_recipe_of(row: dict) -> Fp8Recipe:
    """The fp8 recipe of a run, read from its precision label: "MX" is MXFP8 on Blackwell and 1x128 /
    128x128 block scaling on Hopper (the Bridge pages' note on the parenthesized numbers); "CS", "current"
    and "per-tensor" are current scaling. A bare "FP8" is current scaling on the Megatron-Bridge pages (their
    H100 recipes are the *_FP8_CS_* configs, recipe_settings.json) and delayed scaling elsewhere (NeMo 24.07's
    Transformer Engine 1.x had no other)."""
    prec = str((row.get("plan") or {}).get("precision") or "").lower()
    if "mx" in prec or "blockwise" in prec:
        gpu = GPU_PRESETS.get(str((row.get("hardware") or {}).get("gpu_key") or ""))
        return Fp8Recipe.MXFP8 if gpu is not None and gpu.family == "blackwell" else Fp8Recipe.BLOCKWISE
    if "cs" in prec.replace("-", " ").split() or "current" in prec or "per-tensor" in prec or is_bridge_recipe(row):
        return Fp8Recipe.TENSORWISE
    return Fp8Recipe.DELAYED


def zero_stage(row: dict) -> int | None:
    """The ZeRO stage a run used. Megatron-Bridge's tables have an FSDP column whose 0 means
    "Megatron DDP, not FSDP" (docs/performance-summary-archive.md); its recipes run that DDP with
    the distributed optimizer (recipes/common.py: use_distributed_optimizer=True), which is
    ZeRO-1 in this project's knob, not plain data parallelism. A NeMo / Megatron-Bridge table without the
    column (NeMo 24.07's, Bridge's 26.08 page) ran no FSDP either: their performance recipes shard the optimizer
    (NeMo 1: Apex distributed_fused_adam; NeMo 2 and Bridge: use_distributed_optimizer=True) and turn FSDP on only
    where a table says so; filled as "fastest legal" instead, such a run read as Megatron FSDP once FSDP's
    prefetching made it as fast (d0deab4). Over one data-parallel rank `case_from_row` reads the distributed
    optimizer as zero 0 unless fp8 primary weights need it (`one_rank_stage`)."""
    plan = row.get("plan") or {}
    z = plan.get("zero_key")
    if z is None:
        return 1 if is_nemo_recipe(row) else None
    text = str(plan.get("distributed_optimizer_or_zero") or "")
    if int(z) == 0 and "FSDP=0" in text.replace(" ", "") and is_nemo_recipe(row):
        return 1
    return int(z)


def one_rank_stage(zero: int, plan: dict, fp8_param_gather: bool) -> int:
    """A distributed optimizer over one data-parallel rank (dp x cp = 1) shards nothing and equals zero 0, which
    the space keeps instead (rule zero_needs_dp), unless --fp8-param-gather needs it there (Megatron-Bridge's
    Llama-3 70B LoRA run on 8 H100 has dp 1)."""
    one_rank = _int_or_1(plan.get("dp")) * _int_or_1(plan.get("cp")) == 1
    return 0 if zero == 1 and one_rank and not fp8_param_gather else zero


def runs_deepspeed_zero(row: dict) -> bool:
    """ZeRO-2 exists only in DeepSpeed; a row whose ZeRO column names DeepSpeed (Narayanan et al.'s ZeRO-3
    runs: "DeepSpeed integrated into Megatron") ran DeepSpeed's ZeRO, not Megatron's FSDP."""
    plan = row.get("plan") or {}
    return plan.get("zero_key") == 2 or (plan.get("zero_key") is not None and
                                         "deepspeed" in str(plan.get("distributed_optimizer_or_zero") or "").lower())


def _int_or_1(value) -> int:
    """A plan field as an int for a comparison; what is missing or not a number counts as 1 (case_from_row names it)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1


def runs_megatron_deepspeed(row: dict) -> bool:
    """A run its source says was trained with Megatron-DeepSpeed (the title or the row's notes name it): scored as
    that framework runs (DeepSpeed's pipeline engine, its ZeRO and gradient reduction), whatever its ZeRO column says."""
    src = source_of(row)
    return "megatron-deepspeed" in f"{src.get('title', '')} {row.get('notes', '')}".lower()


_YEAR = re.compile(r"\b(20[0-4]\d)\b")


def framework_is_modern(row: dict) -> bool:
    """The framework defaults the run would have had (the validation README asks for them):
    FlashAttention (2022) and TE's TP-communication overlap (2023) are on in Megatron-Core / NeMo;
    Megatron-LM before 2022 had neither, and Megatron-DeepSpeed leaves both off by default."""
    if runs_megatron_deepspeed(row):
        return False
    src = source_of(row)
    years = [int(y) for y in _YEAR.findall(str(src.get("title", "")))]
    return not (years and max(years) < 2022)


def megatron_2021_options(precision: Precision) -> dict:
    """What Megatron-LM before 2022 ran, for a row that states no launch script (NVIDIA/Megatron-LM@6985e58938,
    2021-08-18, the SC21 artifact's code; launch_settings.json has the same facts per row where a script is
    published): Megatron's LocalDDP by default (--DDP-impl local: one all-reduce after the backward), no
    distributed optimizer, no gradient-accumulation fusion (2022-02-13), a synchronous backward TP all-reduce (the
    asynchronous one was opt-in from 2021-09-02), and gradients reduced in fp32 only for bf16 (arguments.py forces
    accumulate_allreduce_grads_in_fp32 for bf16; off for fp16)."""
    return {"overlap_grad_reduce": False, "overlap_param_gather": False, "gradient_accumulation_fusion": False,
            "async_tensor_model_parallel_allreduce": False, "grad_reduce_in_fp32": precision is not Precision.FP16}


def _split_layout(model: ModelSpec, fixed: dict, framework: Framework = Framework.MEGATRON) -> str | None:
    """The pipeline split a published pp (and vpp) ran with when Megatron-Core's even split cannot
    express it (with or without counting the embedding and loss as layers): the balanced layout
    Megatron-Bridge builds (`balanced_layout`, e.g. DeepSeek-V3's 61 layers on pp=16). DeepSpeed's
    PipelineModule has no account-for flags: it balances the transformer layers over the stages itself
    (at most ceil(L / pp) per stage, as the balanced layout)."""
    pp = fixed.get("pp", 1)
    if pp < 2:
        return None
    vpps = [fixed["vpp"]] if "vpp" in fixed else [1]
    for vpp in vpps:
        for extra in ((0,) if framework is Framework.DEEPSPEED else (0, 1, 2)):
            units = model.num_layers + extra
            if units % pp == 0 and (units // pp) % vpp == 0 and units // pp >= vpp:
                return None
    try:
        return balanced_layout(model.num_layers, pp, vpps[0], model.mtp_num_layers)
    except SpecError:
        return None


def _recipe(row: dict) -> dict:
    """The settings of the recipe behind a published Megatron-Bridge MoE run (autotune/data/
    recipe_settings.json); empty for other rows and where no recipe matched the published parallelism."""
    rec = recipe_settings().get(row.get("id", ""))
    return {} if not rec or rec.get("unknown") else rec


def recipe_vpp(row: dict) -> int | None:
    """The virtual pipeline size of the recipe behind a published Megatron-Bridge run whose parallelism it
    matched (recipe_settings.json provenance): its virtual_pipeline_model_parallel_size, where None means no
    interleaving (Megatron-Core: 1). None where no recipe matched: the knob is then filled as unknown."""
    prov = _recipe(row).get("provenance") or {}
    par = prov.get("recipe_parallelism") or {}
    if not prov.get("match") or "vpp" not in par:
        return None
    return int(par["vpp"] or 1)


def bridge_recipe_options(row: dict) -> dict:
    """The framework options the recipe ran a published Megatron-Bridge run with: for MoE runs its dispatcher,
    batch-level EP overlap and token drop; for every run its CUDA graphs, TP overlap (where recorded), fp8
    attention, and, where the dense rows' reading records them, activation CPU offloading and the distributed
    optimizer's overlap of gradient reduction and parameter gathering."""
    rec = _recipe(row)
    moe = rec.get("moe_token_dispatcher_type") is not None
    if not moe and not str(row.get("id", "")).startswith(DENSE_RECIPE_PREFIX):
        return {}
    out = {}
    extras = rec.get("extras") or {}
    if moe:
        out = {"moe_token_dispatcher_type": DispatcherType.parse(rec["moe_token_dispatcher_type"]),
               "overlap_moe_expert_parallel_comm": bool(rec.get("overlap_moe_expert_parallel_comm"))}
    if extras.get("moe_token_drop"):
        # Bridge's apply_moe_token_drop: --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity
        out["moe_expert_capacity_factor"] = TOKEN_DROP_CAPACITY_FACTOR
    if rec.get("cpu_offloading_num_layers"):         # WorkloadBaseConfig.cpu_offloading_num_layers
        out["cpu_offloading_num_layers"] = int(rec["cpu_offloading_num_layers"])
    for key in ("overlap_grad_reduce", "overlap_param_gather"):
        if rec.get(key) is not None:
            out[key] = bool(rec[key])
    if rec.get("tp_comm_overlap") is not None:      # recorded for the tp > 1 rows (comm_overlap.tp_comm_overlap)
        out["tp_comm_overlap"] = bool(rec["tp_comm_overlap"])
    if extras.get("fp8_dot_product_attention"):
        # mixed_precision.fp8_dot_product_attention: Transformer Engine's fp8 attention, on cuDNN's fused kernel
        out["fp8_dot_product_attention"], out["attention_backend"] = True, AttentionBackend.FUSED
    impl = rec.get("cuda_graph_impl")
    if not impl and extras.get("enable_cuda_graph"):
        impl = "local"              # transformer_config.py: deprecated enable_cuda_graph = cuda_graph_impl local
    if impl and impl != "none":
        scope = rec.get("cuda_graph_scope") or []
        out["cuda_graph_modules"], out["cuda_graph_impl"] = parse_cuda_graph_modules(
            [scope] if isinstance(scope, str) else scope, CudaGraphImpl.parse(impl))
    return out


#: the capacity factor Megatron-Bridge's token-drop recipes set (training/utils/moe_token_drop.py)
TOKEN_DROP_CAPACITY_FACTOR = 1.0
#: ids of the dense rows whose recipes recipe_settings.json reads in full (bridge_dense_runs.json)
DENSE_RECIPE_PREFIX = "mbridge-dense-"


def recipe_account_knobs(row: dict) -> dict:
    """--account-for-embedding/loss-in-pipeline-split as the recipe behind a Megatron-Bridge run set them (the
    dense rows' reading records them; they act only with pp > 1, which the space's rule asks)."""
    extras = _recipe(row).get("extras") or {}
    if _int_or_1((row.get("plan") or {}).get("pp")) < 2:
        return {}
    return {knob: int(bool(extras[f"{knob}_in_pipeline_split"]))
            for knob in ("account_for_embedding", "account_for_loss")
            if extras.get(f"{knob}_in_pipeline_split") is not None}


def recipe_recompute_knobs(row: dict, model: ModelSpec) -> dict:
    """The recomputation the recipe behind a Megatron-Bridge MoE run set (recipe_settings.json):
    no granularity = none; selective with its --recompute-modules (an explicit empty list recomputes
    nothing); full. Empty where no recipe matched or a module does not apply to the model."""
    rec = _recipe(row)
    if "recompute_granularity" not in rec:
        return {}
    gran, mods = rec.get("recompute_granularity"), rec.get("recompute_modules") or []
    if gran == "full":
        return {"recompute": int(Recompute.FULL)}
    if gran != "selective" or not mods:
        return {"recompute": int(Recompute.NONE), "recompute_modules": 0}
    if any(m not in RECOMPUTE_MODULES for m in mods):
        return {}
    mask = modules_mask(mods)
    if mask & ~applicable_modules_mask(model):
        return {}
    return {"recompute": int(Recompute.SELECTIVE), "recompute_modules": mask}


_LORA = re.compile(r"\blora\b", re.IGNORECASE)
#: "packed to 4096": a fine-tuning run whose examples were concatenated into its sequences
_PACKED = re.compile(r"\bpacked\b", re.IGNORECASE)
#: mean tokens per example of the fine-tuning datasets runs name (length-weighted: attention goes as its square).
#: SQuAD v1.1: 98,169 examples (87,599 train + 10,570 validation) in 94.06 MiB as TFDS stores them
#: (tensorflow.org/datasets/catalog/squad), ~1,000 B per example of which ~170 B are ids, titles and feature names:
#: ~830 characters of context, question and answer, ~200 Llama-2 tokens at ~4.2 characters per token (~210 with
#: NeMo's prompt template); length-weighted (paragraphs vary by ~40 %) ~1.15x that. It only has to be right within a
#: factor of ~2: at 200 or 400 tokens NeMo 24.07's six packed rows move by less than a point, against 4,096 unpacked
PACKED_EXAMPLE_TOKENS = {"squad": 240}


def _described(row: dict) -> str:
    """What a row says of itself in words: its id, notes and source table and title (a fine-tuning table names
    its runs' kind in its heading, a row in its id or notes)."""
    src = source_of(row)
    return f"{row.get('id', '')} {row.get('notes', '')} {src.get('table', '')} {src.get('title', '')}"


def packed_example_tokens(row: dict) -> int:
    """The mean example length of a run whose description (or recipe reading: `packed_sequence`, `dataset`) says its
    fine-tuning data was packed, from the dataset it names (PACKED_EXAMPLE_TOKENS); 0 when not packed or the dataset
    is not known (then it is scored unpacked)."""
    rec = _recipe(row)
    if rec.get("packed_sequence") is not None:
        name = str(rec.get("dataset") or "").lower()
        return next((n for key, n in PACKED_EXAMPLE_TOKENS.items() if key in name), 0) if rec["packed_sequence"] else 0
    text = _described(row)
    if not _PACKED.search(text):
        return 0
    low = text.lower()
    return next((n for name, n in PACKED_EXAMPLE_TOKENS.items() if name in low), 0)


#: a NeMo container release named in a row's source or notes ("NeMo 24.07")
_NEMO_RELEASE = re.compile(r"\bNeMo (\d{2})\.(\d{2})\b")
#: the last NeMo 1 release: its fine-tuning (megatron_gpt_finetuning) puts LoRA adapters on attention_qkv alone by
#: default (examples/nlp/language_modeling/tuning/conf/megatron_gpt_finetuning_config.yaml at NVIDIA/NeMo@00780235:
#: peft.lora_tuning.target_modules ['attention_qkv'], adapter_dim 32); NeMo 2 (24.09 on) and Megatron-Bridge put them
#: on all four linears
NEMO1_LAST_RELEASE = (24, 7)


def lora_target_modules_of(row: dict) -> tuple:
    """The LoRA targets a run ran: its recipe's, where the recipe reading records them (recipe_settings.json), else
    its framework's default (NeMo 1's attention_qkv for a NeMo release up to 24.07, else Megatron-Bridge's / NeMo
    2's four linears)."""
    mods = _recipe(row).get("lora_target_modules")
    if mods:
        return parse_lora_modules(mods)
    release = _NEMO_RELEASE.search(_described(row))
    if release and (int(release.group(1)), int(release.group(2))) <= NEMO1_LAST_RELEASE:
        return (LoraModule.LINEAR_QKV,)
    return DEFAULT_LORA_MODULES


#: the adapter rank of a LoRA run that does not state one: Megatron-Bridge's and NeMo's default
#: (peft/lora.py LoRA.dim = 32; NeMo 1's lora_tuning.adapter_dim: 32)
LORA_DIM_DEFAULT = 32


def is_lora(row: dict) -> bool:
    """A LoRA fine-tuning run (its id, notes or source table say so): the base weights frozen, adapters trained."""
    return bool(_LORA.search(_described(row)))


def with_launch_settings(row: dict) -> tuple[dict, dict]:
    """The row with the plan (and model) values its published launch script or paper gives where the row
    says null (autotune/data/launch_settings.json: its own entry, else its source's), and that entry (empty
    when there is none)."""
    group = source_of(row).get("group")
    launch = launch_settings().get(row.get("id", "")) or launch_settings_by_source().get(group or "", {})
    if not launch:
        return row, launch
    out = dict(row)
    for block in ("plan", "model"):
        values = dict(row.get(block) or {})
        for key, val in (launch.get(block) or {}).items():
            if values.get(key) is None:
                values[key] = val
        out[block] = values
    return out, launch


def case_from_row(row: dict) -> RowCase:
    row, launch = with_launch_settings(row)
    for block in ("hardware", "plan", "model", "measured"):
        if row.get(block) is not None and not isinstance(row[block], dict):
            raise SpecError(block, f"must be an object of fields (the validation README's row schema), got "
                            f"{type(row[block]).__name__} {str(row[block])[:40]!r}")
    hw, plan, m = row.get("hardware") or {}, row.get("plan") or {}, row.get("model") or {}
    lora = is_lora(row)
    gpu_key = hw.get("gpu_key")
    if gpu_key not in GPU_PRESETS:
        raise SpecError("hardware.gpu_key", f"unknown GPU {gpu_key!r}")
    prec_key = plan.get("precision_key") or "bf16"
    precision = Precision.parse(prec_key, "plan.precision_key")
    gpu = GPU_PRESETS[gpu_key]
    if gpu.peak_flops(precision) <= 0:
        raise SpecError("plan.precision_key", f"{gpu_key} has no {prec_key} tensor cores")
    if plan.get("global_batch") is None or m.get("seq_len") is None:
        raise SpecError("plan.global_batch", "global batch or sequence length not given")
    model = model_from_row(m)
    n = hw.get("num_gpus")
    if not n:
        raise SpecError("hardware.num_gpus", "not given")
    nic = hw.get("inter_node_gb_per_s")        # a source that states its cluster's NIC (GB/s per GPU per direction)
    if nic is not None and (isinstance(nic, bool) or not isinstance(nic, (int, float)) or not math.isfinite(nic)
                            or not BW_RANGE_GBPS[0] <= nic <= BW_RANGE_GBPS[1]):
        raise SpecError("hardware.inter_node_gb_per_s", f"must be a number of GB/s per GPU from {BW_RANGE_GBPS[0]:g} "
                        f"to {BW_RANGE_GBPS[1]:g}, got {nic!r}")
    cluster = build_cluster(gpu=gpu_key, num_gpus=int(n),
                            gpus_per_node=int(hw["gpus_per_node"]) if hw.get("gpus_per_node") else None,
                            inter_node_bw_gbps=nic)
    modern = framework_is_modern(row)
    recipe = is_nemo_recipe(row)
    bridge = is_bridge_recipe(row)
    fw_kind = Framework.DEEPSPEED if runs_deepspeed_zero(row) or runs_megatron_deepspeed(row) else Framework.MEGATRON
    if fw_kind is Framework.DEEPSPEED and any(_int_or_1(plan.get(k)) > 1 for k in ("cp", "vpp")):
        # a published context-parallel or interleaved plan did not run on DeepSpeed's pipeline engine (which has
        # neither): score it as Megatron-Core runs them rather than refuse the row
        fw_kind = Framework.MEGATRON
    recipe_options = bridge_recipe_options(row)
    framework = FrameworkSpec(
        framework=fw_kind,
        attention_backend=recipe_options.pop("attention_backend",
                                             AttentionBackend.AUTO if modern else AttentionBackend.UNFUSED),
        tp_comm_overlap=recipe_options.pop("tp_comm_overlap", modern),
        # NeMo / Megatron-Bridge benchmark recipes reduce gradients in bf16 (perf_recipes/_common.py
        # sets grad_reduce_in_fp32=False); otherwise the framework's own default
        grad_reduce_in_fp32=not recipe and fw_kind.grad_reduce_in_fp32_default,
        gradient_accumulation_fusion=fw_kind.gradient_accumulation_fusion_default,
        # their delayed-scaling and MXFP8 recipes gather fp8 primary weights (mixed_precision.py)
        fp8_param_gather=recipe and precision in (Precision.FP8, Precision.FP4) and _fp8_param_recipe(row),
        # Megatron-Bridge runs Transformer Engine's fused cross entropy; every other source leaves it to
        # the framework default of its time (Megatron-Core's: off; Megatron-DeepSpeed has none)
        cross_entropy_loss_fusion=bridge,
        cross_entropy_fusion_impl=CrossEntropyImpl.TE if bridge else CrossEntropyImpl.NATIVE,
        fp8_recipe=fp8_recipe_of(row),
        **recipe_options)
    if fw_kind is Framework.MEGATRON and not modern:
        framework = dataclasses.replace(framework, **megatron_2021_options(precision))
    if lora:                          # a LoRA run: its framework's default rank and targets
        framework = dataclasses.replace(framework, lora_dim=int(_recipe(row).get("lora_dim") or LORA_DIM_DEFAULT),
                                        lora_target_modules=lora_target_modules_of(row))
    packed = min(packed_example_tokens(row), int(m["seq_len"]))
    if packed and framework.attention_backend.is_fused:               # packed fine-tuning data (THD attention)
        framework = dataclasses.replace(framework, packed_example_tokens=packed)
    if launch.get("framework"):       # the options its published launch script (or the code of its time) ran with
        stated = framework_spec(**launch["framework"])
        framework = dataclasses.replace(framework, **{k: getattr(stated, k) for k in launch["framework"]})
    if isinstance((row.get("run") or {}).get("framework"), dict):    # a run that states its framework options
        stated_fw = dict(row["run"]["framework"])
        if row["run"].get("runner") == "jax":       # records written before the jax runner named its framework
            stated_fw.setdefault("framework", "jax")
        framework = framework_spec(**stated_fw)
    job = JobSpec(global_batch=int(plan["global_batch"]), seq_len=int(m["seq_len"]), precision=precision,
                  framework=framework)
    fixed, filled = {}, ["lora_dim"] if lora else []
    for knob, key in _KNOWN_PLAN.items():
        val = plan.get(key)
        if val is None and knob == "vpp":
            val = recipe_vpp(row)        # a blank VP column of a Bridge table: the recipe's, None = 1
        if val is None:
            if knob in ("cp", "ep"):
                fixed[knob] = 1
            elif knob != "dp":
                filled.append(knob)
        else:
            fixed[knob] = int(val)
    if plan.get("tp") is None or plan.get("pp") is None:
        raise SpecError("plan.tp", "tp and pp must be given")
    meas = row.get("measured") or {}
    recipe_recompute = recipe_recompute_knobs(row, model)
    if plan.get("recompute_key"):
        fixed["recompute"] = int(Recompute.parse(plan["recompute_key"], "plan.recompute_key"))
        mods = plan.get("recompute_modules")          # a launch script's --recompute-modules (launch_settings.json)
        if mods and fixed["recompute"] == int(Recompute.SELECTIVE):
            mask = modules_mask(mods)
            if mask & ~applicable_modules_mask(model):
                raise SpecError("plan.recompute_modules", f"{mods} names a module this model does not have")
            fixed["recompute_modules"] = mask
    elif recipe_recompute:
        fixed.update(recipe_recompute)
    elif meas.get("hfu") is not None and meas.get("mfu") is None:
        # the source counted the recomputation forward pass in its FLOP rate (stored as hfu, see
        # the validation README), so the run recomputed activations
        fixed["recompute"] = int(Recompute.FULL)
    else:
        filled.append("recompute")
    if plan.get("sequence_parallel") is not None:
        fixed["sp"] = int(bool(plan["sequence_parallel"]) and fixed.get("tp", 1) > 1)
    elif not modern:
        # Megatron-LM's --sequence-parallel came in 2022 (v3.0, Korthikanti et al.); Megatron-DeepSpeed leaves it
        # off by default (a store_true flag): such a run had none, and "fastest legal" would guess it on
        fixed["sp"] = 0
    else:
        filled.append("sp")
    zero = zero_stage(row)
    if zero is not None:
        fixed["zero"] = one_rank_stage(zero, plan, framework.fp8_param_gather)
    else:
        filled.append("zero")
    if plan.get("etp") is not None:                  # a launch script's --expert-tensor-parallel-size
        fixed["etp"] = int(plan["etp"])
    elif not model.is_moe:
        fixed["etp"] = 1
    else:
        filled.append("etp")
    for knob in ("account_for_embedding", "account_for_loss"):      # its --account-for-*-in-pipeline-split
        if plan.get(knob) is not None:
            fixed[knob] = int(bool(plan[knob]))
    for knob, val in recipe_account_knobs(row).items():
        fixed.setdefault(knob, val)
    if plan.get("layout"):                           # its --pipeline-model-parallel-layout (which sets vpp)
        fixed["layout"] = str(plan["layout"])
        stages = len(expand_layout(fixed["layout"]))
        if "vpp" not in fixed and stages % fixed["pp"] == 0:
            fixed["vpp"] = stages // fixed["pp"]
            filled.remove("vpp")
    else:
        layout = _split_layout(model, fixed, fw_kind)
        if layout:
            fixed["layout"] = layout
            filled.append("layout")
    problem = Problem(model, cluster, job)
    measured, why = measured_throughput(row, problem)
    return RowCase(id=row.get("id", "?"), problem=problem, fixed=fixed, filled=filled,
                   measured_tokens_per_s_per_gpu=measured, measured_why=why)


def measured_value(x) -> tuple[float | None, str | None]:
    """A measured figure as a finite positive float, else None and the reason (a NaN, an infinity,
    a string or a zero in one row must not turn a MAPE into NaN)."""
    if x is None:
        return None, "not given by the source"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None, f"not a number ({str(x)[:40]!r})"
    if not math.isfinite(x) or x <= 0:
        return None, f"not a finite positive number ({x!r})"
    return float(x), None


#: tokens/s per GPU and the iteration time of one run may disagree by this much (rounding of published
#: tables; every bundled run agrees within 2 %) before the run is refused as contradicting itself
MEASURED_AGREEMENT_FRAC = 0.05


def measured_throughput(row: dict, problem: Problem) -> tuple[float | None, str | None]:
    """A run's measured tokens/s per GPU: `measured.tokens_per_s_per_gpu`, else derived from
    `measured.iteration_time_s` (global batch x sequence / (GPUs x time)); with both given they must agree
    within MEASURED_AGREEMENT_FRAC. (None, the reason naming the fields) when there is no usable figure. One
    definition for validate and calibrate."""
    meas = row.get("measured") if isinstance(row.get("measured"), dict) else {}
    tok, tok_why = measured_value(meas.get("tokens_per_s_per_gpu"))
    step, step_why = measured_value(meas.get("iteration_time_s"))
    # a figure that is given but unusable is an error in the row: say so, never fall back silently
    for key, value, why in (("tokens_per_s_per_gpu", tok, tok_why), ("iteration_time_s", step, step_why)):
        if meas.get(key) is not None and value is None:
            return None, f"measured.{key}: {why}"
    from_step = problem.job.tokens_per_step / (step * problem.cluster.num_gpus) if step else None
    if tok and from_step and abs(tok / from_step - 1.0) > MEASURED_AGREEMENT_FRAC:
        return None, (f"measured.tokens_per_s_per_gpu ({tok:,.0f}) and measured.iteration_time_s ({step:.4g} s, i.e. "
                      f"{from_step:,.0f} tokens/s per GPU at this batch, sequence and GPU count) disagree by "
                      f"{abs(tok / from_step - 1.0):.0%}; fix one of them")
    if tok or from_step:
        return tok or from_step, None
    return None, "measured: neither tokens_per_s_per_gpu nor iteration_time_s is given by the source"


#: sources whose model TFLOP/s count causal attention (only the visible half of the scores): Megatron-LM's
#: num_floating_point_operations since 8873b55d6a (2025-03-06, "only half of the attention matrix is non-zero"),
#: which the moe_recipes index (2026) logs. Every other source is read as counting all s x s scores, as NVIDIA's
#: formulas did before 2025 (costmodels.flops.full_attention_extra_per_token); a row can state its own count in
#: measured.extra.attention_flops ("causal" or "full").
CAUSAL_ATTENTION_FLOPS_SOURCES = frozenset({"Megatron-LM moe_recipes index"})
ATTENTION_FLOPS_COUNTS = ("causal", "full")


def attention_flops_count(row: dict) -> str:
    """How the source of a row's model TFLOP/s counted attention: "causal" or "full" (see
    CAUSAL_ATTENTION_FLOPS_SOURCES)."""
    meas = row.get("measured") if isinstance(row.get("measured"), dict) else {}
    extra = meas.get("extra")
    stated = extra.get("attention_flops") if isinstance(extra, dict) else None
    if stated is not None:
        # read as Precision.parse and Recompute.parse read theirs: "CAUSAL" and " full" are what they say
        stated = stated.strip().lower() if isinstance(stated, str) else stated
        if stated not in ATTENTION_FLOPS_COUNTS:
            raise SpecError("measured.extra.attention_flops", f"must be one of {', '.join(ATTENTION_FLOPS_COUNTS)}, "
                            f"got {stated!r}")
        return stated
    # Megatron-Bridge (2025 on) logs the causal count: its 51 bundled runs that publish both tokens/s and model TFLOP/s
    # give back their tokens/s within 0.3 % (median) read causal, 10 % (26.08) and 18 % (25.09-26.06) short read full
    causal = source_of(row).get("group") in CAUSAL_ATTENTION_FLOPS_SOURCES or is_bridge_recipe(row)
    return "causal" if causal else "full"


#: sources whose TFLOP/s count the recomputation forward pass whether or not a row gives a percentage of peak:
#: Narayanan et al. 2021 (eq. 3, Appendix; their Table 2 gives TFLOP/s alone, and the bundled rows derive its
#: tokens/s with eq. 3, which the model count reads 4/3 too high)
HARDWARE_FLOPS_SOURCES = frozenset({"Narayanan et al. 2021 (SC21)"})


def counts_recomputation(row: dict) -> bool:
    """Whether a row's TFLOP/s figure counts the recomputation forward pass: its source's percentage of peak is
    stored as hfu, not mfu (the validation README: Narayanan et al. and BLOOM), or its source always does
    (HARDWARE_FLOPS_SOURCES)."""
    meas = row.get("measured") if isinstance(row.get("measured"), dict) else {}
    if meas.get("mfu") is not None:
        return False
    return meas.get("hfu") is not None or source_of(row).get("group") in HARDWARE_FLOPS_SOURCES


def rate_figure(row: dict) -> str | None:
    """The measured field a row's FLOP-rate comparison reads when it gives neither tokens/s nor an iteration time:
    tflops_per_gpu, else mfu / hfu (a share of the GPU's peak); None when it gives none of them."""
    meas = row.get("measured") if isinstance(row.get("measured"), dict) else {}
    if meas.get("tokens_per_s_per_gpu") is not None or meas.get("iteration_time_s") is not None:
        return None
    return next((k for k in ("tflops_per_gpu", "mfu", "hfu") if meas.get(k) is not None), None)


def measured_from_tflops(row: dict, problem: Problem, predicted: dict) -> tuple[float | None, str]:
    """A row that gives only a FLOP rate (the validation README: "can be compared on model TFLOP/s, with that
    caveat"): (its tokens/s per GPU, what it was compared on), or (None, why) when the figure is unusable. The
    tokens/s is the rate divided by the FLOPs per token its source counts: this cost model's (`predicted`'s model
    FLOPs per token, plan-independent; its hardware FLOPs, with the recomputation forward, where the source counts
    that: counts_recomputation) plus the scores it counts and this model does not (attention_flops_count). A bare
    mfu / hfu is a share of the GPU's dense bf16 peak, for a bf16 or fp16 run only (of an fp8 run, sources differ on
    which peak they divide by)."""
    meas = row.get("measured") if isinstance(row.get("measured"), dict) else {}
    field = rate_figure(row)
    value, why = measured_value(meas.get(field))
    if value is None:
        return None, f"measured.{field}: {why}"
    if field == "tflops_per_gpu":
        # above the GPU's dense peak no run can go (as a share of peak above 1, below); an absurd figure such as
        # 1e300 would otherwise overflow the derived tokens/s to inf and the run be neither scored nor skipped
        peak = problem.cluster.gpu.peak_flops(problem.job.precision) / 1e12
        if value > peak:
            return None, (f"measured.tflops_per_gpu: {value!r} is above the GPU's dense "
                          f"{problem.job.precision.value} peak ({peak:,.0f} TFLOP/s)")
        tflops = value
    elif problem.job.precision not in (Precision.BF16, Precision.FP16):
        return None, (f"measured.{field}: a share of peak of a run in {problem.job.precision.value} does not say "
                      "which peak it divides by; give measured.tflops_per_gpu")
    elif value > 1.0:
        return None, f"measured.{field}: a share of peak must be at most 1, got {value!r}"
    else:
        tflops = value * problem.cluster.gpu.peak_flops(Precision.BF16) / 1e12
    try:
        count = attention_flops_count(row)
    except SpecError as exc:
        return None, str(exc)
    ours = predicted["model_tflops_per_gpu"] * 1e12 / predicted["tokens_per_s_per_gpu"]
    passes = 3.0
    hardware = counts_recomputation(row)
    if hardware:
        ours *= predicted["hfu"] / predicted["mfu"]
        plan = predicted["plan"]
        replays = plan["recompute"] == "full" or "core_attn" in (plan.get("recompute_modules") or [])
        passes += float(replays)
    extra = 0.0
    if count == "full":
        extra = float(full_attention_extra_per_token(encode_model(problem.model),
                                                     encode_job(problem.job, problem.cluster), passes))
    kind = "hardware" if hardware else "model"
    of = "" if field == "tflops_per_gpu" else f", {field} x the GPU's bf16 peak"
    return tflops * 1e12 / (ours + extra), f"{kind} TFLOP/s (attention counted {count}{of})"


def rules_broken(problem: Problem, fixed: dict) -> list[dict]:
    """Why no completion of a published plan is legal: the rules that reject every combination of
    its unknown knobs ({rule, reason}), else the rules that reject the most (they fail jointly)."""
    rules = binding_rules(problem, fixed)
    always = [r for r in rules if r[1] >= 1.0]
    return [{"rule": name, "share_rejected": round(frac, 4), "reason": why}
            for name, frac, why in (always or rules[:3])]


def _empty_result(rid, skipped=None) -> dict:
    return {"id": rid, "measured_tokens_per_s_per_gpu": None, "predicted_tokens_per_s_per_gpu": None,
            "predicted_step_time_s": None, "predicted_fits": None, "predicted_memory_gb": None,
            "error_pct": None, "skipped": skipped, "not_in_space": None, "usable": False, "moe": False,
            "filled": [], "plan": None, "group": None, "gpu": None, "compared_on": "tokens/s"}


def _row_result(row: dict, params: EfficiencyParams, calibration_gpu: str | None = None) -> dict:
    hw = row.get("hardware") if isinstance(row.get("hardware"), dict) else {}
    model = row.get("model") if isinstance(row.get("model"), dict) else {}
    res = _empty_result(row.get("id", "?"))
    res.update(usable=bool(row.get("usable")), moe=bool(model.get("num_experts")), gpu=hw.get("gpu_key"),
               group=source_of(row).get("group"))
    if calibration_gpu is not None and str(hw.get("gpu_key")).lower() != str(calibration_gpu).lower():
        res["skipped"] = (f"calibration: fitted for GPU {calibration_gpu!r}, this run is on "
                          f"{hw.get('gpu_key')!r} (not applied to another GPU's runs)")
        return res
    try:
        case = case_from_row(row)
    except (SpecError, ValueError, TypeError, KeyError) as exc:
        res["skipped"] = str(exc)
        return res
    res["filled"] = case.filled
    res["case_id"] = case_id(case)
    meas = case.measured_tokens_per_s_per_gpu
    res["measured_tokens_per_s_per_gpu"] = meas
    # a run that gives neither tokens/s nor an iteration time but a FLOP rate (a bad tokens/s or iteration time is
    # the row's error, never a fallback)
    tflops_only = rate_figure(row) is not None
    if meas is None and not tflops_only:
        res["skipped"] = case.measured_why
        return res
    try:
        result = exhaustive(case.problem, params, top_k=1, fixed=case.fixed)
        best = result.best
    except NothingFits as exc:
        best = exc.closest
    except NoLegalPlan:
        broken = rules_broken(case.problem, case.fixed)
        res["not_in_space"] = broken
        res["skipped"] = ("published plan is not in the legal space: "
                          + "; ".join(f"{b['rule']}: {b['reason']}" for b in broken))
        return res
    if tflops_only:
        meas, how = measured_from_tflops(row, case.problem, best)
        if meas is None:
            res["skipped"] = how
            return res
        res["measured_tokens_per_s_per_gpu"] = meas
        res["compared_on"] = how
    pred = best["tokens_per_s_per_gpu"]
    res.update(predicted_tokens_per_s_per_gpu=pred, predicted_step_time_s=best["step_time_s"],
               predicted_fits=best["fits"], predicted_memory_gb=best["memory_gb"]["total"],
               error_pct=100.0 * (pred - meas) / meas if math.isfinite(pred) else None, plan=best["plan"])
    if res["error_pct"] is None:
        res["skipped"] = f"the cost model predicted {pred!r} tokens/s (not finite)"
    elif not math.isfinite(res["error_pct"]):
        # a measured figure so small (a subnormal float) that the relative error overflows: skipped, not dropped
        given = row["measured"]
        field = rate_figure(row) if tflops_only else next(k for k in ("tokens_per_s_per_gpu", "iteration_time_s")
                                                           if given.get(k) is not None)
        res["error_pct"] = None
        res["skipped"] = (f"measured.{field}: {given[field]!r} gives {meas!r} tokens/s per GPU, too little for a "
                          f"finite error against the predicted {pred:,.0f}")
    return res


def validate_rows(rows: list, params: EfficiencyParams | None = None, only_usable: bool = True,
                  calibration_gpu: str | None = None) -> dict:
    """Predict every row; a row never raises. MAPE over the scored rows. With `calibration_gpu`
    (the GPU a calibration file was fitted for), rows on other GPUs are skipped, saying so."""
    params = params or EfficiencyParams()
    runs = []
    for row in rows:
        if not isinstance(row, dict):
            runs.append(_empty_result("?", f"not a JSON object: {str(row)[:40]!r}"))
            continue
        if only_usable and not row.get("usable", True):
            runs.append(_empty_result(row.get("id"), "not usable (see the row's notes)"))
            continue
        try:
            runs.append(_row_result(row, params, calibration_gpu))
        except Exception as exc:   # a row never crashes the command
            runs.append(_empty_result(row.get("id", "?"), f"internal error: {exc}"))
    return summarize(runs)


def case_id(case: RowCase) -> str:
    """What the cost model is told about a run (problem, framework options, published knobs), as a short id: two
    runs with one id get one prediction, whatever they measured."""
    text = repr((case.problem, sorted(case.fixed.items())))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def repeated_cases(scored: list) -> dict:
    """Scored runs the cost model cannot tell apart (one `case_id`) but measured differently: each group, how far
    apart its measurements are, and the MAPE floor they set on the whole set. The best single prediction for a
    group minimizes sum |p / m_i - 1|, convex and piecewise linear in p with its kinks at the m_i, so one of the
    m_i attains it."""
    by_case: dict = {}
    for r in scored:
        by_case.setdefault(r.get("case_id"), []).append(r)
    groups, floor, by_source = [], 0.0, {}
    n_source: dict = {}
    for r in scored:
        n_source[r.get("group") or "?"] = n_source.get(r.get("group") or "?", 0) + 1
    for cid, rs in by_case.items():
        if cid is None or len(rs) < 2:
            continue
        ms = [r["measured_tokens_per_s_per_gpu"] for r in rs]
        best = min(sum(abs(p / m - 1.0) for m in ms) for p in ms)
        floor += best
        src = rs[0].get("group") or "?"
        by_source[src] = by_source.get(src, 0.0) + best
        groups.append({"case_id": cid, "ids": [r["id"] for r in rs], "measured_tokens_per_s_per_gpu": ms,
                       "spread_pct": 100.0 * (max(ms) / min(ms) - 1.0)})
    groups.sort(key=lambda g: -g["spread_pct"])
    return {"groups": groups, "n_runs": sum(len(g["ids"]) for g in groups),
            "floor_mape_pct": 100.0 * floor / len(scored) if scored else None,
            "floor_by_source_pct": {k: 100.0 * v / n_source[k] for k, v in sorted(by_source.items())}}


def repeated_runs(rows: list) -> dict:
    """`repeated_cases` of a runs file before any prediction (`calibrate` warns with it): each row's case and
    measured throughput; rows that cannot be read or have no measurement are left out."""
    measured = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        try:
            case = case_from_row(row)
        except (SpecError, ValueError, TypeError, KeyError):
            continue
        if case.measured_tokens_per_s_per_gpu is not None:
            measured.append({"id": case.id, "case_id": case_id(case), "group": source_of(row).get("group"),
                             "measured_tokens_per_s_per_gpu": case.measured_tokens_per_s_per_gpu})
    return repeated_cases(measured)


def repeats_warning(rep: dict) -> str | None:
    """One line on the runs the cost model cannot tell apart (None when there are none)."""
    if not rep.get("groups"):
        return None
    worst, n = rep["groups"][0], len(rep["groups"])
    return (f"{rep['n_runs']} runs in {n} group{'s' if n > 1 else ''} are one case each to the cost model (the same "
            f"problem, framework options and plan) but were measured up to {worst['spread_pct']:.1f} % apart "
            f"({', '.join(worst['ids'])}): no prediction matches both, and they put a floor of "
            f"{rep['floor_mape_pct']:.2f} % under the MAPE")


def _error_figures(errs: list) -> dict:
    return {"n": len(errs), "mape_pct": float(np.mean(errs)) if errs else None,
            "max_abs_error_pct": float(np.max(errs)) if errs else None}


def on_tflops(run: dict) -> bool:
    """Whether a scored run was compared on its source's model TFLOP/s (measured_from_tflops), not on tokens/s."""
    return "TFLOP/s" in str(run.get("compared_on", ""))


def summarize(runs: list) -> dict:
    """The MAPE and its breakdowns over the runs compared on tokens/s; runs compared on model TFLOP/s (a FLOPs
    convention in between) are summed up apart, under "tflops"."""
    finite = [r for r in runs if r.get("error_pct") is not None and math.isfinite(r["error_pct"])]
    scored = [r for r in finite if not on_tflops(r)]
    by_tflops = [r for r in finite if on_tflops(r)]
    errs = [abs(r["error_pct"]) for r in scored]
    not_in_space = [{"id": r["id"], "rules": r["not_in_space"]} for r in runs if r.get("not_in_space")]
    out = {
        "runs": runs,
        "mape_pct": float(np.mean(errs)) if errs else None,
        "max_abs_error_pct": float(np.max(errs)) if errs else None,
        "n_scored": len(errs),
        "n_skipped": sum(1 for r in runs if r.get("skipped")),
        "n_predicted_oom": sum(1 for r in runs if r.get("predicted_fits") is False),
        "n_not_in_space": len(not_in_space),
        "not_in_space": not_in_space,
        "repeats": repeated_cases(scored),
    }
    for label, pick in (("dense", lambda r: not r.get("moe")), ("moe", lambda r: r.get("moe"))):
        e = [abs(r["error_pct"]) for r in scored if pick(r)]
        out[f"mape_{label}_pct"] = float(np.mean(e)) if e else None
        out[f"max_abs_error_{label}_pct"] = float(np.max(e)) if e else None
        out[f"n_scored_{label}"] = len(e)
    by_source = lambda r: r.get("group") or "?"                                  # noqa: E731
    out["by_source"] = _grouped_figures(scored, by_source)
    out["by_gpu_generation"] = _grouped_figures(scored, lambda r: gpu_generation(r.get("gpu")))
    out["tflops"] = {**_error_figures([abs(r["error_pct"]) for r in by_tflops]),
                     "by_source": _grouped_figures(by_tflops, by_source)}
    return out


def _grouped_figures(runs: list, of) -> dict:
    """MAPE and max abs error of scored runs grouped by `of(run)`, groups in sorted order."""
    groups: dict = {}
    for r in runs:
        groups.setdefault(of(r), []).append(abs(r["error_pct"]))
    return {g: _error_figures(e) for g, e in sorted(groups.items())}


def load_runs(path: str) -> list:
    data = read_json(path, "FILE")
    if isinstance(data, dict) and "runs" in data:
        data = data["runs"]
    if not isinstance(data, list):
        raise SpecError("FILE", f"{path} must hold a list of runs")
    bad = next((i for i, row in enumerate(data) if not isinstance(row, dict)), None)
    if bad is not None:
        raise SpecError("FILE", f"{path}: run {bad} is not a JSON object (got {type(data[bad]).__name__})")
    return data


def validate_runs(file: str | None = None, *, dataset: str | None = None, params: EfficiencyParams | None = None,
                  calibration: str | None = None, only_usable: bool = True) -> dict:
    """`autotune validate`: the runs of FILE or of a bundled dataset (`autotune.datasets.DATASETS`),
    predicted with the defaults or a calibration file. A calibration fitted for one GPU is applied to
    that GPU's runs only (the others are skipped, saying so); one for a GPU no run uses is refused."""
    from .datasets import dataset_path
    if (file is None) == (dataset is None):
        raise SpecError("FILE", "give a runs file or --dataset "
                                "public|small-scale|korthikanti22|vtrain-multi|bridge-dense (one of them)")
    path = dataset_path(dataset) if dataset is not None else file
    rows = load_runs(path)
    if not rows:
        raise SpecError("FILE", f"{path} holds no runs")
    cal_gpu, source = None, "defaults"
    if calibration:
        from .measurements import read_calibration
        params, doc = read_calibration(calibration)
        source = calibration
        cal_gpu = doc.get("gpu")
        if cal_gpu is not None:
            gpus = sorted({str((r.get("hardware") or {}).get("gpu_key")) for r in rows
                           if isinstance(r.get("hardware"), dict)})
            if str(cal_gpu).lower() not in [g.lower() for g in gpus]:
                raise SpecError("calibration", f"{calibration} was fitted for GPU {cal_gpu!r}, but no run of "
                                f"{path} is on it (GPUs there: {', '.join(gpus) or 'none'})")
    out = validate_rows(rows, params, only_usable=only_usable, calibration_gpu=cal_gpu)
    out.update(source=dataset or file, calibration=source, calibration_gpu=cal_gpu)
    return out
