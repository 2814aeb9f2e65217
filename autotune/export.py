"""Runnable configs from a plan: Megatron-LM arguments, Megatron-Bridge / NeMo 2 recipe overrides,
torchtitan TOML, MaxText YAML and DeepSpeed JSON (issue 13, "Runnable output").

One function per target, `export(target, plan, problem)` in front of them. Each target uses its own
option names (tests/data/export_names/ holds the documented names each is checked against) and
refuses, with one line naming the plan field and the reason, a plan it cannot express: an exporter
never changes a plan silently. `parse_megatron_args` reads Megatron-LM arguments (a command line,
or the argument dump at the top of a Megatron-LM log) back into a plan.

Sources of the option names and their meaning:
  Megatron-LM  megatron/training/arguments.py (validate_args: virtual stages, uneven PP, recompute),
               core/transformer/transformer_config.py, core/model_parallel_config.py
  Bridge       docs/megatron-lm-to-megatron-bridge.md (flag -> override key table),
               src/megatron/bridge/training/config.py, mixed_precision.py, comm_overlap.py
  torchtitan   v0.2.2 torchtitan/config/job_config.py (Parallelism, Training, ActivationCheckpoint)
  MaxText      src/maxtext/configs/base.yml (ici_* / dcn_* mesh axes, pipeline and batch keys)
  DeepSpeed    docs/_pages/config-json.md (batch, zero_optimization, bf16/fp16, tensor_parallel
               (AutoTP), expert_parallel (AutoEP), activation_checkpointing)
  Megatron-DeepSpeed  microsoft/Megatron-DeepSpeed@f4157bea megatron/arguments.py (+ deepspeed's
               add_config_arguments: --deepspeed, --deepspeed_config), megatron/model/gpt_model.py
               (GPTModelPipe), examples_deepspeed/pretrain_llama2_distributed.sh
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from dataclasses import dataclass

from costmodels.plan import Plan, expand_layout, microbatch_group_size
from costmodels.specs import (CrossEntropyImpl, CudaGraphImpl, Fp8Recipe, Framework, PipelineSchedule, Precision,
                              Recompute, SpecError)
from search_spaces.space import Problem, check_plan

TARGETS = ("megatron", "bridge", "torchtitan", "maxtext", "deepspeed", "megatron-deepspeed")


class ExportRefused(SpecError):
    """The target framework cannot express this plan (bad input for that target: exit code 2)."""

    def __init__(self, target: str, plan_field: str, reason: str):
        super().__init__(f"export --to {target}", f"{plan_field}: {reason}")
        self.target = target


@dataclass(frozen=True)
class Exported:
    """One plan in a target's own form: `text` to paste or save, `options` the option names used
    (flags, dotted keys or JSON key paths), `suffix` the usual file extension."""
    target: str
    text: str
    options: tuple
    suffix: str
    #: files the text names, as (file name, text): Megatron-DeepSpeed's --deepspeed_config JSON
    companions: tuple = ()


def _microbatches(plan: Plan, problem: Problem) -> int:
    return problem.job.global_batch // (plan.dp * plan.mbs)


def _even_layers_per_chunk(plan: Plan, problem: Problem) -> int:
    units = problem.model.num_layers + plan.account_for_embedding + plan.account_for_loss
    return units // plan.pp // plan.vpp


def _interleave_group(plan: Plan, problem: Problem) -> int | None:
    """The micro-batch group per virtual stage an interleaved plan needs where pp does not divide its
    micro-batches (None: Megatron-Core's default, pp)."""
    if plan.vpp <= 1:
        return None
    group = int(microbatch_group_size(_microbatches(plan, problem), plan.pp))
    return group if group != plan.pp else None


def _uneven(plan: Plan) -> bool:
    return bool(plan.first_layers or plan.last_layers)


# ------------------------------------------------------------------------------------------------
# Megatron-LM
# ------------------------------------------------------------------------------------------------

#: precision flags (arguments.py --bf16/--fp16; TransformerConfig fp8 / fp4 via --fp8-format / --fp4-format)
_MEGATRON_PRECISION = {
    Precision.BF16: ["--bf16"],
    Precision.FP16: ["--fp16"],
    Precision.FP8: ["--bf16", "--fp8-format", "hybrid"],     # e4m3 forward, e5m2 gradients
    Precision.FP4: ["--bf16", "--fp4-format", "e2m1"],       # NVFP4 (TransformerConfig.fp4)
    Precision.FP32: [],                                       # fp32 is Megatron-LM's default (no --bf16/--fp16)
}


def _moe_layer_freq(model) -> str | None:
    """--moe-layer-freq as Megatron's list expression ("([0]*3+[1]*58)" for DeepSeek-V3's first 3
    dense layers), or None when every layer is MoE."""
    if model.first_k_dense_layers == 0 and model.moe_layer_freq == 1:
        return None
    pattern = [0] * model.first_k_dense_layers + [
        1 if i % model.moe_layer_freq == 0 else 0 for i in range(model.num_layers - model.first_k_dense_layers)]
    return "[" + ",".join(map(str, pattern)) + "]"


def _window_args(m) -> list:
    """Megatron's sliding window: --window-size W,0 (W keys before each query) on every layer, or on all
    but every k-th with --window-attn-skip-freq k (TransformerLayer: layer_number % k != 0, 1-based, the
    pattern of Gemma-2 and GPT-OSS with k = 2 and of Gemma-3 with k = 6); refused when no k gives the
    model's number of window layers."""
    n, L = m.num_sliding_window_layers, m.num_layers
    if not n:
        return []
    if n == L:
        return ["--window-size", f"{m.sliding_window},0"]
    # the cost depends on the count only; of the k that give it, the largest (Gemma-3's 6 at 12 layers, not 5)
    freq = next((k for k in range(L, 1, -1) if L - L // k == n), None)
    if freq is None:
        raise ExportRefused("megatron", "model.sliding_window_layers", f"{n} of {L} layers with a window is not "
                            "every layer but every k-th, which is what --window-attn-skip-freq can say")
    return ["--window-size", f"{m.sliding_window},0", "--window-attn-skip-freq", freq]


def _layer_shape_args(m) -> list:
    """The layer-shape flags Megatron-LM and Megatron-DeepSpeed spell alike."""
    a = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size, "--ffn-hidden-size", m.ffn_hidden_size,
         "--num-attention-heads", m.num_attention_heads]
    if m.head_dim and m.head_dim != m.hidden_size // m.num_attention_heads:
        a += ["--kv-channels", m.head_dim]
    return a


def _vocab_args(m) -> list:
    """Untied output layer and a NullTokenizer of the model's vocabulary (mock data needs no tokenizer file);
    the same flags in Megatron-LM and Megatron-DeepSpeed."""
    return (["--untie-embeddings-and-output-weights"] if not m.tied_embeddings else []) + [
        "--vocab-size", m.vocab_size, "--tokenizer-type", "NullTokenizer"]


def megatron_model_args(problem: Problem) -> list:
    """Model shape flags for pretrain_gpt.py (a NullTokenizer of the model's vocabulary, so mock data
    runs without a tokenizer file)."""
    m, job = problem.model, problem.job
    a = _layer_shape_args(m)
    if m.num_kv_heads != m.num_attention_heads:
        a += ["--group-query-attention", "--num-query-groups", m.num_kv_heads]
    a += ["--seq-length", job.seq_len, "--max-position-embeddings", max(job.seq_len, m.max_seq_len)]
    if m.gated_mlp:        # Llama-style: SwiGLU, RMSNorm, RoPE, no biases (GPT-OSS keeps Megatron's default biases)
        a += ["--swiglu" if m.glu_activation == "silu" else "--quick-geglu", "--normalization", "RMSNorm",
              "--position-embedding-type", "rope"]
        if m.activation_clamp:       # GPT-OSS's clamped GLU (TransformerConfig fields of the same names)
            a += ["--activation-func-clamp-value", f"{m.activation_clamp:g}"]
        if m.glu_linear_offset:
            a += ["--glu-linear-offset", f"{m.glu_linear_offset:g}"]
        a += [] if m.expert_bias else ["--disable-bias-linear"]
        if m.position_embedding == "yarn":     # YaRN-scaled RoPE runs unfused (the cost model's rope_unfused)
            a += ["--rope-type", "yarn", "--no-rope-fusion"]
    if m.attention_sinks:      # GPT-OSS's learnable softmax offset per head (TransformerConfig.softmax_type)
        a += ["--softmax-type", "learnable"]
    a += _window_args(m) + _vocab_args(m)
    if m.is_moe:
        a += ["--num-experts", m.num_experts, "--moe-router-topk", m.experts_per_token,
              "--moe-ffn-hidden-size", m.moe_ffn_hidden_size, "--moe-grouped-gemm"]
        if m.num_shared_experts:
            a += ["--moe-shared-expert-intermediate-size",
                  m.num_shared_experts * (m.shared_expert_ffn_hidden_size or m.moe_ffn_hidden_size)]
        freq = _moe_layer_freq(m)
        if freq:
            a += ["--moe-layer-freq", freq]
    if m.is_mla:
        a += ["--multi-latent-attention", "--kv-lora-rank", m.kv_lora_rank, "--qk-head-dim", m.qk_nope_head_dim,
              "--qk-pos-emb-head-dim", m.qk_rope_head_dim, "--v-head-dim", m.v_head_dim]
        if m.q_lora_rank:
            a += ["--q-lora-rank", m.q_lora_rank]
    if m.mtp_num_layers:
        a += ["--mtp-num-layers", m.mtp_num_layers]
    return [str(x) for x in a]


def megatron_plan_args(plan: Plan, problem: Problem, target: str = "megatron") -> list:
    """The plan's parallelism, pipeline split, recompute, optimizer, batch and precision flags.

    Refused: ZeRO-2 (DeepSpeed only; Megatron has the distributed optimizer = zero 1 and
    Megatron-FSDP = zero 3)."""
    check_plan(plan, problem)
    _refuse_other_trainer(target, problem)     # launch and the megatron runner come here without export()
    _refuse_unsettable(target, problem)
    fw = problem.job.framework
    if plan.pp > 1 and fw.pipeline_schedule is PipelineSchedule.GPIPE:
        raise ExportRefused(target, "pipeline_schedule=gpipe", "Megatron-Core schedules pipelines with 1F1B "
                            "(interleaved when vpp > 1); it has no GPipe schedule")
    if fw.cross_entropy_loss_fusion and fw.cross_entropy_fusion_impl is CrossEntropyImpl.TE:
        raise ExportRefused(target, "cross_entropy_fusion_impl=te", "Megatron-LM's arguments refuse Transformer "
                            "Engine's fused cross entropy (arguments.py: stability issues); score the plan with "
                            "--cross-entropy-fusion-impl native, or export --to bridge")
    if plan.zero == 2:
        raise ExportRefused(target, "zero=2", "ZeRO-2 exists only in DeepSpeed; Megatron has the distributed "
                            "optimizer (zero=1) and Megatron-FSDP (zero=3)")
    _refuse_megatron_deepspeed(target, problem)
    a = ["--tensor-model-parallel-size", plan.tp, "--pipeline-model-parallel-size", plan.pp,
         "--context-parallel-size", plan.cp]
    if problem.model.is_moe:
        a += ["--expert-model-parallel-size", plan.ep, "--expert-tensor-parallel-size", plan.etp]
    if plan.sp:
        a += ["--sequence-parallel"]
    # pipeline split (arguments.py validate_args: at most one of the three virtual-stage flags)
    if plan.layout:
        a += ["--pipeline-model-parallel-layout", plan.layout]
    else:
        if plan.vpp > 1:
            a += (["--num-virtual-stages-per-pipeline-rank", plan.vpp] if _uneven(plan)
                  else ["--num-layers-per-virtual-pipeline-stage", _even_layers_per_chunk(plan, problem)])
        if plan.first_layers:
            a += ["--decoder-first-pipeline-num-layers", plan.first_layers]
        if plan.last_layers:
            a += ["--decoder-last-pipeline-num-layers", plan.last_layers]
        if plan.account_for_embedding:
            a += ["--account-for-embedding-in-pipeline-split"]
        if plan.account_for_loss:
            a += ["--account-for-loss-in-pipeline-split"]
    if plan.recompute is Recompute.SELECTIVE:
        a += ["--recompute-granularity", "selective", "--recompute-modules", *plan.recompute_modules]
    elif plan.recompute is Recompute.FULL:
        # uniform with 1 layer per group replays every layer; block N replays the first N of a chunk
        a += ["--recompute-granularity", "full"] + (
            ["--recompute-method", "block", "--recompute-num-layers", plan.recompute_layers] if plan.recompute_layers
            else ["--recompute-method", "uniform", "--recompute-num-layers", 1])
    if plan.zero >= 1:
        a += ["--use-distributed-optimizer"]
    if plan.zero == 3:
        a += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    if fw.overlap_grad_reduce:
        a += ["--overlap-grad-reduce"]
    if fw.overlap_param_gather and fw.overlap_grad_reduce and plan.zero >= 1:    # Megatron asserts both
        a += ["--overlap-param-gather"]
    a += ["--micro-batch-size", plan.mbs, "--global-batch-size", problem.job.global_batch]
    group = _interleave_group(plan, problem)
    if group:
        a += ["--microbatch-group-size-per-virtual-pipeline-stage", group]
    a += _MEGATRON_PRECISION[problem.job.precision]
    recipe = problem.job.fp8_recipe
    if recipe is not None and recipe is not Fp8Recipe.DELAYED:    # delayed is the default (and all older Megatron has)
        a += ["--fp8-recipe", recipe.value]
    if not fw.grad_reduce_in_fp32:
        a += ["--grad-reduce-in-bf16"]
    if not fw.gradient_accumulation_fusion:
        a += ["--no-gradient-accumulation-fusion"]
    if fw.fp8_param_gather:     # low-precision primary weights: Megatron names the fp4 form --fp4-param-gather
        a += ["--fp4-param-gather" if problem.job.precision is Precision.FP4 else "--fp8-param-gather"]
    if fw.tp_comm_overlap:
        a += ["--tp-comm-overlap"]
    a += ["--attention-backend", fw.attention_backend.value]
    if fw.cross_entropy_loss_fusion:     # Megatron's default is off; native (the only impl it accepts) its default,
        a += ["--cross-entropy-loss-fusion"]    # so Megatron-LM from before --cross-entropy-fusion-impl runs it too
    if problem.model.is_moe:
        a += ["--moe-token-dispatcher-type", fw.moe_token_dispatcher_type.value]
        if fw.moe_permute_fusion:        # Megatron's default is off (unfused: FrameworkSpec.moe_permute_fusion)
            a += ["--moe-permute-fusion"]
    if fw.overlap_moe_expert_parallel_comm:
        a += ["--overlap-moe-expert-parallel-comm"]
    if fw.cpu_offloading_num_layers:      # arguments.py turns --cpu-offloading on for N > 0 (activations only)
        a += ["--cpu-offloading-num-layers", fw.cpu_offloading_num_layers]
    if fw.cuda_graph_impl is not CudaGraphImpl.NONE:
        # arguments.py: --cuda-graph-modules (nargs='+'; none = the whole layer); full_iteration asserts
        # --no-check-for-nan-in-loss-and-grad
        a += ["--cuda-graph-impl", fw.cuda_graph_impl.value]
        if fw.cuda_graph_modules:
            a += ["--cuda-graph-modules", *(m.value for m in fw.cuda_graph_modules)]
        if fw.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION:
            a += ["--no-check-for-nan-in-loss-and-grad"]
    return [str(x) for x in a]


def _refuse_other_trainer(target: str, problem: Problem) -> None:
    """A plan scored for a JAX trainer, or as a fine-tuning job (LoRA, packed sequences) that only
    Megatron-Bridge runs: refused by every other target, `launch` and the megatron runner included."""
    fw = problem.job.framework
    if fw.framework is Framework.JAX and target != "maxtext":
        raise ExportRefused(target, "framework=jax", "the plan was scored as one XLA-compiled step (a JAX "
                            "trainer); export it to maxtext, or score it with --framework megatron")
    if fw.packed_example_tokens and target != "bridge":
        raise ExportRefused(target, f"packed_example_tokens={fw.packed_example_tokens}",
                            "the plan was scored with packed sequences (attention inside each example), which "
                            "Megatron-Bridge's fine-tuning datasets set up (packed_sequence_specs); export it --to bridge")
    if fw.lora_dim and target != "bridge":
        raise ExportRefused(target, f"lora_dim={fw.lora_dim}", f"LoRA fine-tuning is Megatron-"
                            f"Bridge's PEFT; {target} has no LoRA setting here: export it --to bridge")


def _refuse_megatron_deepspeed(target: str, problem: Problem) -> None:
    """A plan scored for Megatron-DeepSpeed has its own exporter: Megatron-Core's flags would run another framework."""
    if problem.job.framework.framework is Framework.DEEPSPEED:
        raise ExportRefused(target, "framework=deepspeed", "the plan was scored as Megatron-DeepSpeed runs it "
                            "(DeepSpeed's pipeline engine and ZeRO, its unfused loss); export it --to "
                            "megatron-deepspeed (--out writes its DeepSpeed config beside it), or score it with "
                            "--framework megatron")


def _refuse_sync_tp(target: str, problem: Problem) -> None:
    """A plan scored as 2021 Megatron-LM ran (a synchronous backward TP all-reduce) has no switch in any
    framework run today."""
    if not problem.job.framework.async_tensor_model_parallel_allreduce:
        raise ExportRefused(target, "async_tensor_model_parallel_allreduce=false", "current Megatron-Core always "
                            "overlaps the backward TP collective with the weight-gradient GEMM (the switch was removed); "
                            "score the plan with the default to export it")


def _refuse_fp8_attention(target: str, problem: Problem) -> None:
    """Transformer Engine's fp8 attention is a Megatron-Core TransformerConfig field that no exported command
    can set: Megatron-LM's arguments.py lists it among the fields with no CLI argument, and a Megatron-Bridge
    mixed_precision preset (the override this export names) sets fp8_dot_product_attention=False over the model
    config at runtime (MixedPrecisionConfig.setup); its GB200 recipes set it in Python instead."""
    if not problem.job.framework.fp8_dot_product_attention:
        return
    how = {"megatron": "Megatron-LM's pretrain arguments have no flag for it (a TransformerConfig field only)",
           "bridge": "the mixed_precision preset this export names turns it off over model.* at runtime; set "
                     "cfg.mixed_precision.fp8_dot_product_attention=True in the recipe, as its GB200 recipes do"}
    raise ExportRefused(target, "fp8_dot_product_attention=true",
                        how.get(target, f"Transformer Engine's fp8 attention is a Megatron-Core setting; {target} "
                                        "has none") + "; or score the plan without --fp8-dot-product-attention")


def _refuse_unsettable(target: str, problem: Problem) -> None:
    """What no exported command of any target can set: 2021's synchronous TP all-reduce, fp8 attention."""
    _refuse_sync_tp(target, problem)
    _refuse_fp8_attention(target, problem)


def _refuse_cuda_graphs(target: str, problem: Problem) -> None:
    """The plan was scored with Megatron-Core's CUDA graphs (or its batch-level EP overlap, or its activation CPU
    offloading), which other frameworks do not run."""
    _refuse_unsettable(target, problem)
    if problem.job.framework.overlap_moe_expert_parallel_comm:
        raise ExportRefused(target, "overlap_moe_expert_parallel_comm=true", f"Megatron-Core's batch-level EP "
                            f"overlap has no {target} setting; score the plan without it, or export --to megatron / bridge")
    impl = problem.job.framework.cuda_graph_impl
    if impl is not CudaGraphImpl.NONE:
        raise ExportRefused(target, f"cuda_graph_impl={impl.value}", f"Megatron-Core's CUDA graphs have no {target} "
                            "setting; score the plan with --cuda-graph-impl none, or export --to megatron / bridge")
    n_off = problem.job.framework.cpu_offloading_num_layers
    if n_off:
        raise ExportRefused(target, f"cpu_offloading_num_layers={n_off}", f"Megatron-Core's activation CPU offloading "
                            f"has no {target} setting; score the plan without --cpu-offloading-num-layers, or export "
                            "--to megatron / bridge")


def megatron_args(plan: Plan, problem: Problem) -> list:
    """Every pretrain_gpt.py flag the plan and the problem decide (model shape + plan)."""
    return megatron_model_args(problem) + megatron_plan_args(plan, problem)


def _flags(argv) -> tuple:
    return tuple(dict.fromkeys(t for t in argv if str(t).startswith("--")))


def _args_text(target: str, argv: list) -> Exported:
    """A command line as one flag (and its values) per continued shell line."""
    lines, cur = [], []
    for tok in argv:
        if tok.startswith("--") and cur:
            lines.append(" ".join(cur))
            cur = []
        cur.append(shlex.quote(tok))
    lines.append(" ".join(cur))
    return Exported(target, " \\\n".join(lines) + "\n", _flags(argv), ".args")


def _megatron(plan: Plan, problem: Problem) -> Exported:
    return _args_text("megatron", megatron_args(plan, problem))


# ---- parsing Megatron arguments back into a plan --------------------------------------------------

#: flags that take several values (nargs='+')
_NARGS = {"recompute_modules", "cuda_graph_modules"}


def parse_megatron_argv(argv) -> dict:
    """A Megatron-LM command line (tokens) -> {arg_name_with_underscores: value}; store-true flags
    map to True, --recompute-modules to a list. Tokens that are not flags of ours are kept too."""
    toks = [str(t) for t in argv]
    out: dict = {}
    i = 0
    while i < len(toks):
        t = toks[i]
        if not t.startswith("--"):
            i += 1
            continue
        key = t[2:].replace("-", "_")
        if "=" in key:
            key, val = key.split("=", 1)
            out[key] = val
            i += 1
            continue
        vals = []
        j = i + 1
        while j < len(toks) and not toks[j].startswith("--"):
            vals.append(toks[j])
            j += 1
        if key in _NARGS:
            out[key] = vals
        elif not vals:
            out[key] = True
        else:
            out[key] = vals[0]
        i = j
    return out


_ARG_DUMP = re.compile(r"^\s*([a-z_][a-z0-9_]*) \.+ (.*?)\s*$")


def parse_megatron_arg_dump(text: str) -> dict:
    """The `------ arguments ------` block Megatron-LM prints at start (arguments.py _print_args:
    "  name ........ value", sorted) -> {name: value as text}. Empty when the log has none."""
    out = {}
    inside = False
    for line in text.splitlines():
        if "arguments ------" in line and "end of" not in line:
            inside = True
            continue
        if "end of arguments" in line:
            break
        if inside:
            m = _ARG_DUMP.match(line.split("] ", 1)[-1] if line.startswith("[") else line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def _int(values: dict, key: str, default: int | None = None) -> int | None:
    v = values.get(key)
    if v in (None, "None", True):
        return default
    try:
        return int(str(v))
    except ValueError:
        raise SpecError(f"megatron-args.{key}", f"expected an integer, got {v!r}") from None


def _flag(values: dict, key: str) -> bool:
    v = values.get(key, False)
    return v is True or str(v) == "True"


def _modules(v) -> tuple:
    if v in (None, "None"):
        return ()
    if isinstance(v, str):      # the dump prints a Python list: ['core_attn', 'mlp']
        v = re.findall(r"[a-z_]+", v)
    return tuple(v)


def plan_from_megatron_args(values: dict, world_size: int | None = None, num_layers: int | None = None,
                            is_moe: bool = False) -> Plan:
    """Megatron-LM arguments (parse_megatron_argv or parse_megatron_arg_dump) -> Plan. The data-parallel
    size is the dump's `data_parallel_size`, else world_size / (tp * cp * pp). Expert sizes are read
    when the arguments name experts (--num-experts) or `is_moe` says the model has them."""
    from costmodels.plan import modules_mask, modules_of_mask

    tp = _int(values, "tensor_model_parallel_size", 1)
    pp = _int(values, "pipeline_model_parallel_size", 1)
    cp = _int(values, "context_parallel_size", 1)
    dp = _int(values, "data_parallel_size")
    world = world_size or _int(values, "world_size")
    if dp is None:
        if not world:
            raise SpecError("megatron-args", "neither data_parallel_size nor the world size is known")
        if world % (tp * cp * pp):
            raise SpecError("megatron-args", f"world size {world} does not divide by tp*cp*pp = {tp * cp * pp}")
        dp = world // (tp * cp * pp)
    layers = _int(values, "num_layers", num_layers)
    layout = values.get("pipeline_model_parallel_layout")
    layout = "" if layout in (None, "None") else str(layout)
    first = _int(values, "decoder_first_pipeline_num_layers", 0) or 0
    last = _int(values, "decoder_last_pipeline_num_layers", 0) or 0
    acc_e = _flag(values, "account_for_embedding_in_pipeline_split")
    acc_l = _flag(values, "account_for_loss_in_pipeline_split")
    vpp = _int(values, "virtual_pipeline_model_parallel_size") or _int(values, "num_virtual_stages_per_pipeline_rank")
    per_chunk = _int(values, "num_layers_per_virtual_pipeline_stage")
    if layout:
        vpp = max(1, len(expand_layout(layout)) // pp)
    elif vpp is None and per_chunk:
        if not layers:
            raise SpecError("megatron-args", "--num-layers-per-virtual-pipeline-stage needs --num-layers")
        vpp = (layers + acc_e + acc_l) // pp // per_chunk
    gran = values.get("recompute_granularity")
    recompute = Recompute.NONE if gran in (None, "None") else Recompute.parse(str(gran), "megatron-args.recompute_granularity")
    modules: tuple = ()
    rec_layers = 0
    if recompute is Recompute.SELECTIVE:
        modules = modules_of_mask(modules_mask(_modules(values.get("recompute_modules")) or ("core_attn",)))
    elif recompute is Recompute.FULL and str(values.get("recompute_method")) == "block":
        rec_layers = _int(values, "recompute_num_layers", 0) or 0
    zero = 0
    if _flag(values, "use_megatron_fsdp") or _flag(values, "use_torch_fsdp2"):
        zero = 3
    elif _flag(values, "use_distributed_optimizer"):
        zero = 1
    # Megatron: --expert-tensor-parallel-size defaults to the TP size; a dense model has no experts
    # (its argument dump still shows the derived value)
    moe = _int(values, "num_experts") is not None if "num_experts" in values else is_moe
    etp = (_int(values, "expert_tensor_parallel_size") or tp) if moe else 1
    ep = _int(values, "expert_model_parallel_size", 1) if moe else 1
    return Plan(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp,
                vpp=vpp or 1, mbs=_int(values, "micro_batch_size", 1), recompute=recompute, recompute_modules=modules,
                sp=_flag(values, "sequence_parallel"), zero=zero, account_for_embedding=acc_e and not layout,
                account_for_loss=acc_l and not layout, first_layers=first, last_layers=last,
                recompute_layers=rec_layers, layout=layout)


def parse_megatron_args(argv, world_size: int, num_layers: int | None = None, is_moe: bool = False) -> Plan:
    """A Megatron-LM command line -> the plan it runs (the inverse of megatron_plan_args)."""
    return plan_from_megatron_args(parse_megatron_argv(argv), world_size, num_layers, is_moe)


# ------------------------------------------------------------------------------------------------
# Megatron-Bridge / NeMo 2 recipe overrides
# ------------------------------------------------------------------------------------------------

_BRIDGE_PRECISION = {Precision.BF16: "bf16_mixed", Precision.FP16: "fp16_mixed"}
#: Megatron-Bridge's low-precision presets (training/mixed_precision.py), with the low-precision primary weights
#: each sets (fp8_param_gather; fp4_param_gather for nvfp4): the preset is applied to model, optimizer and ddp at
#: runtime (runtime_config_update -> MixedPrecisionConfig.setup), over any model / ddp override. Current scaling
#: keeps fp8 primary weights too (bf16_with_fp8_current_scaling_mixed: fp8_param_gather = True in every tag from
#: v0.1.0rc3 to v0.6.0; the table said False until the dense Bridge rows' reading found it); subchannel scaling
#: and, before v0.4.0, nvfp4 do not
BRIDGE_FP8_PRESETS = {Fp8Recipe.DELAYED: ("bf16_with_fp8_delayed_scaling_mixed", True),
                       Fp8Recipe.TENSORWISE: ("bf16_with_fp8_current_scaling_mixed", True),
                       Fp8Recipe.MXFP8: ("bf16_with_mxfp8_mixed", True),
                       Fp8Recipe.BLOCKWISE: ("bf16_with_fp8_subchannel_scaling_mixed", False)}
BRIDGE_FP4_PRESET = ("bf16_with_nvfp4_mixed", True)


def _bridge_precision(problem: Problem) -> str:
    """The mixed_precision preset of the job; a low-precision preset whose primary weights differ from the
    plan's --fp8-param-gather is refused (the preset wins at runtime)."""
    job = problem.job
    if job.precision is Precision.FP8:
        what, (preset, gather) = f"{job.fp8_recipe.value} preset", BRIDGE_FP8_PRESETS[job.fp8_recipe]
    elif job.precision is Precision.FP4:
        what, (preset, gather) = "nvfp4 preset", BRIDGE_FP4_PRESET
    else:
        return _BRIDGE_PRECISION[job.precision]
    if job.framework.fp8_param_gather != gather:
        raise ExportRefused("bridge", f"fp8_param_gather={str(job.framework.fp8_param_gather).lower()}",
                            f"Megatron-Bridge's {what} {preset} {'keeps' if gather else 'does not keep'} "
                            f"low-precision primary weights, over the model and ddp configs at runtime; "
                            f"{'add' if gather else 'drop'} --fp8-param-gather")
    return preset


def _val(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


def bridge_overrides(plan: Plan, problem: Problem) -> list:
    """Hydra-style `group.field=value` overrides for Megatron-Bridge's run_recipe.py / NeMo 2
    recipes (the mapping of docs/megatron-lm-to-megatron-bridge.md)."""
    check_plan(plan, problem)
    _refuse_unsettable("bridge", problem)
    fw, job = problem.job.framework, problem.job
    if job.precision not in (Precision.BF16, Precision.FP16, Precision.FP8, Precision.FP4):
        raise ExportRefused("bridge", f"precision={job.precision.value}", "Megatron-Bridge's recipes are mixed "
                            "precision (bf16, fp16, fp8, fp4)")
    if plan.pp > 1 and fw.pipeline_schedule is PipelineSchedule.GPIPE:
        raise ExportRefused("bridge", "pipeline_schedule=gpipe", "Megatron-Core schedules pipelines with 1F1B "
                            "(interleaved when vpp > 1); it has no GPipe schedule")
    if plan.zero == 2:
        raise ExportRefused("bridge", "zero=2", "ZeRO-2 exists only in DeepSpeed; Megatron-Bridge has the "
                            "distributed optimizer (zero=1) and Megatron-FSDP (zero=3)")
    _refuse_megatron_deepspeed("bridge", problem)
    o = [("model.tensor_model_parallel_size", plan.tp), ("model.pipeline_model_parallel_size", plan.pp),
         ("model.context_parallel_size", plan.cp), ("model.sequence_parallel", plan.sp)]
    if problem.model.is_moe:
        o += [("model.expert_model_parallel_size", plan.ep), ("model.expert_tensor_parallel_size", plan.etp),
              ("model.moe_token_dispatcher_type", fw.moe_token_dispatcher_type.value),
              ("model.moe_permute_fusion", fw.moe_permute_fusion)]
    # the model's MTP modules as scored (null: none; Megatron-Bridge's DeepSeek-V3 provider defaults to 1)
    o += [("model.mtp_num_layers", problem.model.mtp_num_layers or "null")]
    if plan.layout:
        o += [("model.pipeline_model_parallel_layout", plan.layout)]
    else:
        # a recipe's own layout (Bridge's DeepSeek-V3 recipe builds one for its default pp / vpp) would override
        # the plan's split: none
        o += [("model.pipeline_model_parallel_layout", "null"),
              ("model.virtual_pipeline_model_parallel_size", plan.vpp if plan.vpp > 1 else "null")]
        if plan.first_layers:
            o += [("model.num_layers_in_first_pipeline_stage", plan.first_layers)]
        if plan.last_layers:
            o += [("model.num_layers_in_last_pipeline_stage", plan.last_layers)]
        o += [("model.account_for_embedding_in_pipeline_split", plan.account_for_embedding),
              ("model.account_for_loss_in_pipeline_split", plan.account_for_loss)]
    group = _interleave_group(plan, problem)
    if group:
        o += [("model.microbatch_group_size_per_vp_stage", group)]
    if plan.recompute is Recompute.SELECTIVE:
        o += [("model.recompute_granularity", "selective"), ("model.recompute_modules", plan.recompute_modules)]
    elif plan.recompute is Recompute.FULL:
        o += [("model.recompute_granularity", "full"),
              ("model.recompute_method", "block" if plan.recompute_layers else "uniform"),
              ("model.recompute_num_layers", plan.recompute_layers or 1)]
    else:
        o += [("model.recompute_granularity", "null")]
    o += [("model.attention_backend", fw.attention_backend.value), ("model.seq_length", job.seq_len),
          ("dataset.seq_length", job.seq_len), ("train.micro_batch_size", plan.mbs),
          ("train.global_batch_size", job.global_batch),
          ("ddp.use_distributed_optimizer", plan.zero >= 1), ("optimizer.use_distributed_optimizer", plan.zero >= 1)]
    if plan.zero == 3:
        o += [("ddp.use_megatron_fsdp", True), ("ddp.data_parallel_sharding_strategy", "optim_grads_params")]
    o += [("ddp.grad_reduce_in_fp32", fw.grad_reduce_in_fp32), ("ddp.overlap_grad_reduce", fw.overlap_grad_reduce),
          ("ddp.overlap_param_gather", fw.overlap_param_gather and plan.zero >= 1),
          ("mixed_precision", _bridge_precision(problem)), ("comm_overlap.tp_comm_overlap", fw.tp_comm_overlap)]
    if fw.overlap_moe_expert_parallel_comm:
        o += [("comm_overlap.overlap_moe_expert_parallel_comm", True)]
    if not fw.gradient_accumulation_fusion:
        o += [("model.gradient_accumulation_fusion", False)]
    if fw.cpu_offloading_num_layers:
        # Megatron-Bridge sets the TransformerConfig fields themselves (its Llama-3 70B FSDP recipes:
        # cpu_offloading_num_layers via WorkloadBaseConfig, overrides.py); activations only, Megatron's default
        o += [("model.cpu_offloading", True), ("model.cpu_offloading_num_layers", fw.cpu_offloading_num_layers)]
    if fw.lora_dim:
        # a finetune recipe built with peft="lora" (ConfigContainer.peft = peft/lora.py LoRA): its rank and targets
        o += [("peft.dim", fw.lora_dim), ("peft.target_modules", [m.value for m in fw.lora_target_modules])]
    o += [("model.cross_entropy_loss_fusion", fw.cross_entropy_loss_fusion)]
    if fw.cross_entropy_loss_fusion:
        o += [("model.cross_entropy_fusion_impl", fw.cross_entropy_fusion_impl.value)]
    if fw.cuda_graph_impl is not CudaGraphImpl.NONE:
        # docs/training/cuda-graphs.md "Bridge Configuration": model.cuda_graph_impl, model.cuda_graph_scope
        # (Megatron-Core migrates it to cuda_graph_modules), the TE RNG tracker (config.py syncs
        # rng.te_rng_tracker with it); full_iteration asserts check_for_nan_in_loss is off
        o += [("model.cuda_graph_impl", fw.cuda_graph_impl.value),
              ("model.cuda_graph_scope", [m.value for m in fw.cuda_graph_modules]), ("model.use_te_rng_tracker", True)]
        if fw.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION:
            o += [("rerun_state_machine.check_for_nan_in_loss", False)]
    return [f"{k}={_val(v)}" for k, v in o]


def _bridge(plan: Plan, problem: Problem) -> Exported:
    ov = bridge_overrides(plan, problem)
    return Exported("bridge", " \\\n".join(ov) + "\n", tuple(o.split("=", 1)[0] for o in ov), ".overrides")


# ------------------------------------------------------------------------------------------------
# torchtitan (v0.2 TOML job config)
# ------------------------------------------------------------------------------------------------

def _stage_layer_counts(plan: Plan, problem: Problem) -> list:
    """Transformer layers of each virtual stage in Megatron's order (stage i = chunk i // pp on
    rank i % pp), for the split the plan names."""
    L, pp, v = problem.model.num_layers, plan.pp, plan.vpp
    n = pp * v
    if plan.layout:
        return [s.count("t") + s.count("m") for s in expand_layout(plan.layout)]
    if _uneven(plan):
        others = pp - (plan.first_layers > 0) - (plan.last_layers > 0)
        rest = L - plan.first_layers - plan.last_layers
        mid = rest // others // v if others else 0
        per_rank = [mid * v] * pp
        if plan.first_layers:
            per_rank[0] = plan.first_layers
        if plan.last_layers:
            per_rank[-1] = plan.last_layers
        return [per_rank[i % pp] // v for i in range(n)]
    per = (L + plan.account_for_embedding + plan.account_for_loss) // n
    counts = [per] * n
    counts[0] -= plan.account_for_embedding
    counts[-1] -= plan.account_for_loss
    return counts


def _titan_fqns(plan: Plan, problem: Problem) -> list:
    """torchtitan module_fqns_per_model_part: the module names of each model chunk, in stage order
    (Llama-style names: tok_embeddings, layers.N, norm, output)."""
    counts = _stage_layer_counts(plan, problem)
    parts, nxt = [], 0
    for i, c in enumerate(counts):
        names = (["tok_embeddings"] if i == 0 else []) + [f"layers.{j}" for j in range(nxt, nxt + c)]
        nxt += c
        if i == len(counts) - 1:
            names += ["norm", "output"]
        parts.append(names)
    return parts


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


def torchtitan_config(plan: Plan, problem: Problem) -> dict:
    """{section: {key: value}} of a torchtitan job config. Refused: the distributed optimizer and
    ZeRO-2 (torchtitan shards with FSDP2: zero=3, or replicates: zero=0), TP without sequence
    parallelism (torchtitan's TP always shards the sequence in norms), selective (module) recompute,
    block recompute, expert-TP other than 1 or tp, expert ranks that
    are not FSDP-sharded ranks, fp16 and fp4."""
    check_plan(plan, problem)
    t = "torchtitan"
    _refuse_cuda_graphs(t, problem)
    if plan.zero in (1, 2):
        raise ExportRefused(t, f"zero={plan.zero}", "torchtitan has no ZeRO-1/2 optimizer sharding; it replicates "
                            "(zero=0, data_parallel_replicate_degree) or shards with FSDP2 (zero=3)")
    if plan.tp > 1 and not plan.sp:
        raise ExportRefused(t, "sp=false", "torchtitan's tensor parallelism always shards activations along the "
                            "sequence (sequence parallelism); use sp=true")
    if plan.recompute is Recompute.SELECTIVE:
        # distributed/activation_checkpoint.py: op-level SAC saves the ops of a save list (attention
        # kernels among them) but recomputes every second matmul; no setting recomputes a module set
        raise ExportRefused(t, "recompute=selective", "torchtitan's selective checkpointing (per-op: every "
                            "second matmul recomputed, attention saved) is not Megatron's module recompute; "
                            "use recompute=full or none")
    if plan.recompute_layers:
        raise ExportRefused(t, f"recompute_layers={plan.recompute_layers}",
                            "torchtitan checkpoints every n-th layer, not the first n layers of each chunk")
    if problem.model.mtp_num_layers:
        raise ExportRefused(t, f"mtp_num_layers={problem.model.mtp_num_layers}", "torchtitan's models have no "
                            "multi-token prediction modules; score the plan with --mtp-num-layers 0")
    if problem.model.is_moe and plan.etp not in (1, plan.tp):
        raise ExportRefused(t, f"etp={plan.etp}", f"torchtitan supports expert-TP 1 or equal to tp={plan.tp}")
    shard = plan.dp if plan.zero == 3 else 1
    if problem.model.is_moe and (shard * plan.cp * plan.tp) % (plan.ep * plan.etp):
        # parallel_dims.py: the expert mesh is (pp, dp_replicate, efsdp, ep, etp) with
        # efsdp = dp_shard * cp * tp / (etp * ep): EP borrows from the sharded DP ranks, never replicas
        raise ExportRefused(t, f"ep={plan.ep}", f"torchtitan takes expert ranks from dp_shard*cp*tp = "
                            f"{shard * plan.cp * plan.tp} (FSDP-sharded ranks, not replicas), which ep*etp = "
                            f"{plan.ep * plan.etp} must divide; use zero=3")
    if problem.job.precision in (Precision.FP16, Precision.FP4, Precision.FP32):
        raise ExportRefused(t, f"precision={problem.job.precision.value}", "torchtitan trains in bf16 mixed "
                            "precision (fp8 through its float8 converter); fp16, fp4 and fp32 are not offered here")
    m = _microbatches(plan, problem)
    par = {"data_parallel_replicate_degree": plan.dp if plan.zero == 0 else 1,
           "data_parallel_shard_degree": plan.dp if plan.zero == 3 else 1,
           "tensor_parallel_degree": plan.tp, "context_parallel_degree": plan.cp,
           "pipeline_parallel_degree": plan.pp}
    if problem.model.is_moe:
        par["expert_parallel_degree"] = plan.ep
        par["expert_tensor_parallel_degree"] = plan.etp
    rounds = max(1, m // plan.pp)
    if plan.vpp > 1 and m % rounds:
        # torch.distributed.pipelining ScheduleInterleaved1F1B: max(1, m // pp) rounds of equal size
        raise ExportRefused(t, f"vpp={plan.vpp}", f"torchtitan's Interleaved1F1B splits the {m} micro-batches into "
                            f"{rounds} equal rounds (m // pp), which {m} is not a multiple of")
    if plan.pp > 1:
        gpipe = problem.job.framework.pipeline_schedule is PipelineSchedule.GPIPE
        par["pipeline_parallel_schedule"] = "Interleaved1F1B" if plan.vpp > 1 else ("GPipe" if gpipe else "1F1B")
        par["pipeline_parallel_microbatch_size"] = plan.mbs
        par["module_fqns_per_model_part"] = _titan_fqns(plan, problem)
    training = {"global_batch_size": problem.job.global_batch,
                # without PP a DP rank runs mbs sequences per step and accumulates m of them; with PP
                # its local batch is split into pipeline micro-batches of mbs
                "local_batch_size": plan.mbs * m if plan.pp > 1 else plan.mbs,
                "seq_len": problem.job.seq_len, "mixed_precision_param": "bfloat16"}
    ac = {"mode": "full" if plan.recompute is Recompute.FULL else "none"}
    cfg = {"training": training, "parallelism": par, "activation_checkpoint": ac}
    if problem.job.precision is Precision.FP8:
        cfg["model"] = {"converters": ["float8"]}
    return cfg


def _torchtitan(plan: Plan, problem: Problem) -> Exported:
    cfg = torchtitan_config(plan, problem)
    lines = [f"# torchtitan job config (v0.2 TOML) for {problem.model.name} on {problem.cluster.num_gpus} GPUs"]
    for sec, kv in cfg.items():
        lines += ["", f"[{sec}]"] + [f"{k} = {_toml_value(v)}" for k, v in kv.items()]
    return Exported("torchtitan", "\n".join(lines) + "\n",
                    tuple(f"{s}.{k}" for s, kv in cfg.items() for k in kv), ".toml")


# ------------------------------------------------------------------------------------------------
# MaxText (YAML overrides of configs/base.yml)
# ------------------------------------------------------------------------------------------------

def _split_ici_dcn(degrees: list, domain: int, t: str) -> list:
    """Each (axis, degree) -> (axis, ici, dcn): axes fill the NVLink domain (ICI) innermost first,
    in Megatron's rank order (tensor, context, expert/data, stage), the rest goes over the network (DCN)."""
    left = domain
    out = []
    for axis, d in degrees:
        g = math.gcd(d, left)
        out.append((axis, g, d // g))
        left //= g
    if left != 1:
        raise ExportRefused(t, "plan", f"the parallel degrees do not fill the {domain}-GPU NVLink domain "
                            f"(MaxText's ici_* product must equal the devices of one slice)")
    return out


def maxtext_config(plan: Plan, problem: Problem) -> dict:
    """MaxText keys. Refused: ZeRO-2, uneven or accounted pipeline splits and layouts (MaxText splits
    the decoder layers evenly), micro-batch counts that are not a multiple of pp with PP, expert-TP,
    fp16 and fp4, selective recompute of module sets MaxText's remat policies do not name."""
    check_plan(plan, problem)
    t = "maxtext"
    _refuse_cuda_graphs(t, problem)
    if plan.zero == 2:
        raise ExportRefused(t, "zero=2", "MaxText shards the optimizer over data (zero=1) or everything over "
                            "fsdp (zero=3), never gradients alone")
    if plan.layout or _uneven(plan) or plan.account_for_embedding or plan.account_for_loss:
        raise ExportRefused(t, "pipeline split", "MaxText splits the decoder layers evenly over stages; uneven "
                            "first/last stages, account_for_* and layouts cannot be expressed")
    if plan.etp != 1:
        raise ExportRefused(t, f"etp={plan.etp}", "MaxText has no separate expert tensor parallelism")
    if problem.job.precision in (Precision.FP16, Precision.FP4, Precision.FP32):
        raise ExportRefused(t, f"precision={problem.job.precision.value}", "MaxText offers bfloat16 and fp8 "
                            "quantization here; fp16 and fp4 are not expressed")
    if plan.recompute_layers:
        raise ExportRefused(t, f"recompute_layers={plan.recompute_layers}", "MaxText remat policies apply to every layer")
    if plan.recompute is Recompute.SELECTIVE and plan.recompute_modules != ("core_attn",):
        raise ExportRefused(t, "recompute_modules=" + "+".join(plan.recompute_modules),
                            "MaxText's remat policies name no such module set; use recompute_modules=core_attn "
                            "(policy 'minimal': the attention output is recomputed) or recompute=full")
    if plan.dp % plan.ep:
        raise ExportRefused(t, f"ep={plan.ep}", f"MaxText's expert axis splits the data-parallel ranks (dp={plan.dp}); "
                            "Megatron's folding of experts over tp/cp ranks cannot be expressed")
    m = _microbatches(plan, problem)
    if plan.pp > 1 and m % plan.pp:
        raise ExportRefused(t, "mbs", f"with pipeline parallelism MaxText needs the micro-batch count ({m}) to be "
                            f"a multiple of pp={plan.pp}")
    n = problem.cluster.num_gpus
    data_axis = "fsdp" if plan.zero == 3 else "data"
    tensor_axis = "tensor_sequence" if plan.sp else "tensor"
    degrees = [(tensor_axis, plan.tp), ("context", plan.cp), ("expert", plan.ep), (data_axis, plan.dp // plan.ep),
               ("pipeline", plan.pp)]
    domain = min(problem.cluster.nvlink_domain_size, n)
    # max_utils.get_num_slices: a user value wins; GPU devices carry no slice index, so say how many
    # NVLink domains the DCN axes span
    cfg: dict = {"num_slices": n // domain}
    for axis, ici, dcn in _split_ici_dcn(degrees, domain, t):
        cfg[f"ici_{axis}_parallelism"] = ici
        cfg[f"dcn_{axis}_parallelism"] = dcn
    other = "data" if data_axis == "fsdp" else "fsdp"
    cfg[f"ici_{other}_parallelism"] = 1
    cfg[f"dcn_{other}_parallelism"] = 1
    if plan.zero == 1:
        cfg["shard_optimizer_over_data"] = True
    if problem.model.mtp_num_layers:
        cfg["mtp_num_layers"] = problem.model.mtp_num_layers     # MaxText's MTP (base.yml; 0 = off)
    # global batch = per_device_batch_size * devices * gradient_accumulation_steps (pyconfig)
    if plan.pp > 1:
        cfg.update(per_device_batch_size=problem.job.global_batch / n, gradient_accumulation_steps=1,
                   num_pipeline_microbatches=m,
                   num_layers_per_pipeline_stage=problem.model.num_layers // (plan.pp * plan.vpp),
                   num_pipeline_repeats=plan.vpp)
    else:
        cfg.update(per_device_batch_size=plan.mbs * plan.dp / n, gradient_accumulation_steps=m)
    cfg["max_target_length"] = problem.job.seq_len
    # layers/decoders.py get_remat_policy: 'full' saves nothing; 'minimal' saves every projection
    # (q/k/v/out, MLP) and recomputes the attention output 'context' = Megatron's selective core_attn;
    # 'minimal_with_context' saves all of them (only cheap unnamed elementwise ops are replayed)
    cfg["remat_policy"] = {Recompute.NONE: "minimal_with_context", Recompute.SELECTIVE: "minimal",
                           Recompute.FULL: "full"}[plan.recompute]
    cfg["dtype"] = "bfloat16"
    if problem.job.precision is Precision.FP8:
        cfg["quantization"] = "fp8"
    cfg["hardware"] = "gpu"
    return cfg


def _yaml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def _maxtext(plan: Plan, problem: Problem) -> Exported:
    cfg = maxtext_config(plan, problem)
    lines = [f"# MaxText overrides of configs/base.yml for {problem.model.name} on {problem.cluster.num_gpus} GPUs",
             f"# ici_* = inside one {problem.cluster.nvlink_domain_size}-GPU NVLink domain, dcn_* = across domains"]
    lines += [f"{k}: {_yaml_value(v)}" for k, v in cfg.items()]
    return Exported("maxtext", "\n".join(lines) + "\n", tuple(cfg), ".yml")


# ------------------------------------------------------------------------------------------------
# DeepSpeed (config JSON)
# ------------------------------------------------------------------------------------------------

def _refuse_deepspeed_precision(target: str, problem: Problem) -> None:
    if problem.job.precision in (Precision.FP8, Precision.FP4):
        raise ExportRefused(target, f"precision={problem.job.precision.value}", "DeepSpeed's config has bf16 and "
                            "fp16 mixed precision only")


def deepspeed_config(plan: Plan, problem: Problem) -> dict:
    """A DeepSpeed config. For a plan scored with --framework megatron it is plain DeepSpeed's (AutoTP
    for tp, AutoEP for ep); refused: pipeline parallelism (stages are a PipelineModule in the training
    script, not the JSON), context parallelism, sequence parallelism (AutoTP has none), expert-TP,
    selective or block recompute, fp8 and fp4. For a plan scored with --framework deepspeed it is the
    config Megatron-DeepSpeed reads (--deepspeed_config, `export --to megatron-deepspeed`): tp, pp, sp
    and recompute are Megatron-DeepSpeed arguments there, so only the batch, ZeRO and precision remain."""
    check_plan(plan, problem)
    t = "deepspeed"
    _refuse_cuda_graphs(t, problem)
    mds = problem.job.framework.framework is Framework.DEEPSPEED
    if plan.pp > 1 and not mds:
        raise ExportRefused(t, f"pp={plan.pp}", "DeepSpeed's config JSON has no pipeline degree (it is "
                            "PipelineModule(num_stages=...) in the training script); for Megatron-DeepSpeed score "
                            "the plan with --framework deepspeed and export --to megatron-deepspeed too")
    if plan.cp > 1:
        raise ExportRefused(t, f"cp={plan.cp}", "DeepSpeed's config has no context (ring-attention) parallelism")
    if plan.tp > 1 and plan.sp and not mds:
        raise ExportRefused(t, "sp=true", "DeepSpeed AutoTP has no Megatron-style sequence parallelism")
    if plan.etp != 1 and not mds:
        raise ExportRefused(t, f"etp={plan.etp}", "DeepSpeed AutoEP accepts only expert_tensor_parallel_size 1")
    if (plan.recompute is Recompute.SELECTIVE or plan.recompute_layers) and not mds:
        raise ExportRefused(t, "recompute", "DeepSpeed checkpoints whole layers (the model's checkpoint calls); "
                            "selective or block recompute is not expressed in its config")
    _refuse_deepspeed_precision(t, problem)
    cfg: dict = {"train_batch_size": problem.job.global_batch, "train_micro_batch_size_per_gpu": plan.mbs,
                 "gradient_accumulation_steps": _microbatches(plan, problem),
                 "bf16": {"enabled": problem.job.precision is Precision.BF16},
                 "fp16": {"enabled": problem.job.precision is Precision.FP16},
                 "zero_optimization": {"stage": plan.zero, "overlap_comm": problem.job.framework.overlap_grad_reduce,
                                       "contiguous_gradients": True}}
    if problem.job.framework.grad_reduce_in_fp32:     # its default is the model's dtype (engine.py)
        cfg["communication_data_type"] = "fp32"
    if plan.tp > 1 and not mds:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    if problem.model.is_moe and plan.ep > 1 and not mds:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": plan.ep}
    if plan.recompute is Recompute.FULL:
        cfg["activation_checkpointing"] = {"partition_activations": plan.tp > 1, "contiguous_memory_optimization": False}
    return cfg


def _json_paths(obj, prefix=()) -> list:
    out = []
    for k, v in obj.items():
        out.append(".".join(prefix + (k,)))
        if isinstance(v, dict):
            out += _json_paths(v, prefix + (k,))
    return out


def _deepspeed(plan: Plan, problem: Problem) -> Exported:
    cfg = deepspeed_config(plan, problem)
    return Exported("deepspeed", json.dumps(cfg, indent=2) + "\n", tuple(_json_paths(cfg)), ".json")


# ------------------------------------------------------------------------------------------------
# Megatron-DeepSpeed (pretrain_gpt.py arguments)
# ------------------------------------------------------------------------------------------------

#: the DeepSpeed config the exported command names: `export --to deepspeed` of the same plan
MDS_CONFIG_FILE = "ds_config.json"


def megatron_deepspeed_args(plan: Plan, problem: Problem, config_name: str = MDS_CONFIG_FILE) -> list:
    """microsoft/Megatron-DeepSpeed pretrain_gpt.py flags for a plan scored with --framework deepspeed (the
    search space already keeps to what it runs: no interleaving, no CP, core-attention-only selective
    recompute, DeepSpeed's own layer split). Refused: plans scored for another framework, Megatron-Core's
    MoE / MLA / windowed attention / YaRN (Megatron-DeepSpeed's MoE is DeepSpeed-MoE, a different layer),
    a pipeline layout, fp8 / fp4, cuDNN fused attention and TE's TP overlap, which it has no flag for."""
    t = "megatron-deepspeed"
    check_plan(plan, problem)
    _refuse_cuda_graphs(t, problem)
    fw, m, job = problem.job.framework, problem.model, problem.job
    if fw.framework is not Framework.DEEPSPEED:
        raise ExportRefused(t, f"framework={fw.framework.value}", "the plan was scored for another framework; score "
                            "it with --framework deepspeed (Megatron-DeepSpeed's pipeline engine, ZeRO and loss)")
    if m.is_moe:
        raise ExportRefused(t, "model (MoE)", "Megatron-DeepSpeed's MoE is DeepSpeed-MoE (capacity-factor gating, "
                            "--num-experts / --moe-expert-parallel-size), not the Megatron-Core MoE layer the plan was "
                            "scored with")
    for bad, why in ((m.is_mla, "multi-latent attention"), (m.sliding_window, "sliding-window attention"),
                     (m.position_embedding == "yarn", "YaRN-scaled RoPE"),
                     (m.glu_activation != "silu" or m.activation_clamp or m.glu_linear_offset,
                      f"{m.glu_activation} GLU with a clamp or a linear offset (it has --swiglu)"),
                     (m.mtp_num_layers, "multi-token prediction (--mtp-num-layers)")):
        if bad:
            raise ExportRefused(t, "model", f"Megatron-DeepSpeed has no {why}")
    if plan.layout:
        raise ExportRefused(t, f"layout={plan.layout}", "Megatron-DeepSpeed has no layout flag: DeepSpeed's "
                            "PipelineModule balances the transformer layers over the stages itself "
                            "(partition_method='type:transformer')")
    _refuse_deepspeed_precision(t, problem)
    if fw.tp_comm_overlap:
        raise ExportRefused(t, "tp_comm_overlap=true", "Transformer Engine's userbuffers TP overlap is a "
                            "Megatron-Core option; score the plan without --tp-comm-overlap")
    if fw.gradient_accumulation_fusion:
        raise ExportRefused(t, "gradient_accumulation_fusion=true", "Megatron-DeepSpeed's linear layers never "
                            "fuse the gradient accumulation into the weight-gradient GEMM (its fused path is commented "
                            "out); score the plan with --no-gradient-accumulation-fusion, the deepspeed default")
    # auto: Megatron-DeepSpeed's one fused kernel (AttentionBackend.kernel)
    backend = {"auto": ["--use-flash-attn-v2"], "flash": ["--use-flash-attn-v2"],
               "unfused": []}.get(fw.attention_backend.value)
    if backend is None:
        raise ExportRefused(t, f"attention_backend={fw.attention_backend.value}", "Megatron-DeepSpeed runs "
                            "FlashAttention (--use-flash-attn-v2) or its own unfused attention, not cuDNN's fused "
                            "kernel")
    a = _layer_shape_args(m)
    if m.num_kv_heads != m.num_attention_heads:
        a += ["--num-key-value-heads", m.num_kv_heads]
    a += ["--seq-length", job.seq_len, "--max-position-embeddings", max(job.seq_len, m.max_seq_len)]
    if m.gated_mlp:        # Llama-style, as its examples_deepspeed/pretrain_llama2_distributed.sh sets it
        a += ["--swiglu", "--normalization", "rmsnorm", "--use-rotary-position-embeddings", "--disable-bias-linear"]
    a += _vocab_args(m)
    a += ["--tensor-model-parallel-size", plan.tp, "--pipeline-model-parallel-size", plan.pp]
    if plan.pp == 1:
        # without it Megatron-DeepSpeed still builds DeepSpeed's PipelineModule (arguments.py
        # ds_pipeline_enabled), which refuses ZeRO-2/3
        a += ["--no-pipeline-parallel"]
    if plan.sp:
        a += ["--sequence-parallel"]
    if plan.recompute is Recompute.SELECTIVE:      # the core attention (the search allows nothing else here)
        a += ["--recompute-granularity", "selective"]
    elif plan.recompute is Recompute.FULL:
        a += ["--deepspeed-activation-checkpointing", "--recompute-granularity", "full"] + (
            ["--recompute-method", "block", "--recompute-num-layers", plan.recompute_layers] if plan.recompute_layers
            else ["--recompute-method", "uniform", "--recompute-num-layers", 1])
    a += ["--micro-batch-size", plan.mbs, "--global-batch-size", job.global_batch]
    a += {Precision.BF16: ["--bf16"], Precision.FP16: ["--fp16"], Precision.FP32: []}[job.precision]
    a += backend
    a += ["--deepspeed", "--deepspeed_config", config_name, "--zero-stage", plan.zero]
    return [str(x) for x in a]


def _megatron_deepspeed(plan: Plan, problem: Problem, name: str | None = None) -> Exported:
    """The command line and, as a companion, the DeepSpeed config it names (`<name>_ds_config.json` when the
    caller names the files, else ds_config.json): `export --to deepspeed` of the same plan."""
    config_name = f"{name}_ds_config.json" if name else MDS_CONFIG_FILE
    argv = megatron_deepspeed_args(plan, problem, config_name)
    config = _deepspeed(plan, problem)        # its JSON must exist too: refuse here what that export refuses
    return dataclasses.replace(_args_text("megatron-deepspeed", argv), companions=((config_name, config.text),))


_EXPORTERS = {"megatron": _megatron, "bridge": _bridge, "torchtitan": _torchtitan, "maxtext": _maxtext,
              "deepspeed": _deepspeed, "megatron-deepspeed": _megatron_deepspeed}


def parse_target(text: str) -> str:
    t = str(text).strip().lower()
    if t not in _EXPORTERS:
        raise SpecError("to", f"unknown export format {text!r}; choose one of {', '.join(TARGETS)}")
    return t


def export(target: str, plan: Plan, problem: Problem, name: str | None = None) -> Exported:
    """The plan as `target` runs it, or ExportRefused (a SpecError) naming the plan field and why. `name`: the
    stem of the files it will be written to, for a target whose text names a companion file."""
    target = parse_target(target)
    _refuse_other_trainer(target, problem)
    if target == "megatron-deepspeed":
        return _megatron_deepspeed(plan, problem, name)
    return _EXPORTERS[target](plan, problem)
