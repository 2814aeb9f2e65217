"""The notes `search`, `predict`, `explain` and `whatif` print under the problem: what the cost model counts for it
(sliding windows, unfused RoPE, the cross entropy, DeepSpeed's MoE, LoRA, packing, fp8 recipes and attention, the
attention kernel)."""
from __future__ import annotations

from costmodels.specs import Fp8Recipe, Framework


def sliding_window_note(problem) -> str:
    """A note when the model's sliding window is shorter than the sequence: what the cost model counts."""
    m, seq = problem.model, problem.job.seq_len
    window = m.sliding_window
    if window and seq > window:
        flash = ("fused attention computes only the key blocks inside the window there" if problem.job.flash_attention
                 else "unfused attention still computes the whole score matrix and masks it")
        return (f"Note: {m.name} has a sliding attention window of {window:,} tokens on "
                f"{m.num_sliding_window_layers} of {m.num_layers} layers (sequence {seq:,}); {flash}.")
    return ""


def rope_note(problem) -> str:
    """A note when Megatron runs the model's RoPE unfused (YaRN as its own position embedding)."""
    from costmodels.encode import rope_runs_unfused
    if rope_runs_unfused(problem.model) and problem.job.framework.framework is not Framework.JAX:
        return (f"Note: {problem.model.name} uses YaRN-scaled RoPE, which Megatron runs unfused (PyTorch ops: "
                "12 kernels per query or key tensor forward, 7 backward); costed.")
    return ""


def cross_entropy_note(problem) -> str:
    """A note when the job runs the unfused vocab-parallel cross entropy (Megatron without
    --cross-entropy-loss-fusion, or Megatron-DeepSpeed, which has no fused one)."""
    from costmodels.compute import LOSS_BYTES_PER_LOGIT
    from costmodels.encode import cross_entropy_kind
    fw = problem.job.framework
    if cross_entropy_kind(fw) != "unfused":
        return ""
    fix = ("Megatron-DeepSpeed has no fused one" if fw.framework is Framework.DEEPSPEED
           else f"--cross-entropy-loss-fusion moves {LOSS_BYTES_PER_LOGIT['native']:.0f}")
    return (f"Note: the loss runs unfused (PyTorch ops over an fp32 copy of the {problem.model.vocab_size:,}-wide "
            f"logits, {LOSS_BYTES_PER_LOGIT['unfused']:.0f} B per logit forward + backward; {fix}); costed.")


def deepspeed_moe_note(problem) -> str:
    """A note when a Mixture-of-Experts model is scored for Megatron-DeepSpeed, whose MoE layer is DeepSpeed-MoE."""
    if problem.model.is_moe and problem.job.framework.framework is Framework.DEEPSPEED:
        return (f"Note: {problem.model.name} is scored with Megatron-Core's MoE layer (dropless token dispatch); "
                "Megatron-DeepSpeed runs DeepSpeed-MoE (capacity-factor gating), which is not modeled, and "
                "export --to megatron-deepspeed refuses MoE models.")
    return ""


def lora_note(problem) -> str:
    """What a LoRA job is scored as: frozen base weights, adapters on the target linears."""
    fw = problem.job.framework
    if not fw.lora_dim:
        return ""
    targets = ", ".join(m.value for m in fw.lora_target_modules)
    return (f"Note: LoRA fine-tuning (Megatron-Bridge peft=LoRA(dim={fw.lora_dim}) on {targets}): the base weights, "
            "embedding and output layer are frozen (no weight gradients, optimizer states or gradient reduction for "
            "them); model FLOPs count 4 per parameter per token, as NeMo's tables do.")


def packing_note(problem) -> str:
    """What packed sequences change: attention inside each example."""
    n = problem.job.framework.packed_example_tokens
    if not n:
        return ""
    return (f"Note: packed sequences: examples of {n:,} tokens on average share each {problem.job.seq_len:,}-token "
            "sequence and attention stays inside each example (THD layout): attention time and FLOPs are counted "
            f"over ~{n / 2:,.0f} keys per query instead of {problem.job.seq_len / 2:,.0f}.")


def fp8_recipe_note(problem) -> str:
    """A note when --fp8-recipe names a recipe the job does not run (it trains in bf16 / fp16 / fp4, or the jax
    runner scales its own), and when the recipe is current scaling, whose amax passes the cost model charges."""
    job = problem.job
    chosen = job.framework.fp8_recipe
    if job.fp8_recipe is None and chosen is not Fp8Recipe.DELAYED:
        why = ("the jax framework scales its own fp8" if job.framework.framework is Framework.JAX
               else f"the job trains in {job.precision.value}")
        return f"Note: --fp8-recipe {chosen.value} has no effect: {why}."
    if job.fp8_recipe is Fp8Recipe.TENSORWISE:
        return ("Note: fp8 current scaling (tensorwise) measures each tensor's amax in a kernel of its own before "
                "the cast: 2 more bytes per cast element and 2 more kernels per cast; costed.")
    return ""


def fp8_attention_note(problem) -> str:
    """A note when the attention core runs in fp8: what the cost model charges, and that no export sets it."""
    from costmodels.compute import FP8_MMA_X
    if not problem.job.fp8_attention:
        return ""
    return (f"Note: the attention core runs in fp8 (Transformer Engine on cuDNN), costed with its MMAs at "
            f"{FP8_MMA_X:g}x the bf16 rate and its softmax exponentials unchanged (1.5x a bf16 forward on H100 at head "
            "dim 128), plus the casts of Q, K, V, O and dO; no exported command can set it (see export).")


def attention_kernel_note(problem) -> str:
    """A note when the job runs FlashAttention-2 where Transformer Engine's default would run cuDNN (Hopper, Blackwell)."""
    from costmodels.compute import attention_kernel_rate
    gpu = problem.cluster.gpu
    rate = attention_kernel_rate(problem.job.attention_kernel(gpu), gpu.family)
    if rate >= 1.0:
        return ""
    fw = problem.job.framework
    how = ("Megatron-DeepSpeed's fused attention is FlashAttention-2" if fw.framework is Framework.DEEPSPEED
           else "--attention-backend flash runs FlashAttention-2")
    return (f"Note: {how}, which reaches {rate:.2f}x the rate of cuDNN's fused attention on {gpu.name} (measured "
            f"on H100 / H200); costed. " + ("" if fw.framework is Framework.DEEPSPEED else
                                             "auto (Megatron-Core's default) lets Transformer Engine pick cuDNN."))


def problem_notes(problem) -> list:
    """The notes `search` and `predict` print under the problem: what the cost model counts for it."""
    return [n for n in (sliding_window_note(problem), rope_note(problem), cross_entropy_note(problem),
                        deepspeed_moe_note(problem), lora_note(problem), packing_note(problem),
                        fp8_recipe_note(problem), fp8_attention_note(problem), attention_kernel_note(problem)) if n]
