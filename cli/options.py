"""Typer option types shared by the commands (one definition of each flag)."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

ModelOpt = Annotated[str, typer.Option("--model", help="Model preset name or path to a Hugging Face config.json.")]
GpuOpt = Annotated[Optional[str], typer.Option("--gpu", help="GPU preset (a100-80gb, h100, b200, ...).")]
GpusOpt = Annotated[Optional[int], typer.Option("--gpus", help="Number of GPUs.")]
GlobalBatchOpt = Annotated[Optional[int], typer.Option("--global-batch", help="Global batch in sequences.")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", help="Sequence length in tokens.")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="bf16, fp16, fp8, fp4 or fp32 (no mixed precision).")]
GpusPerNodeOpt = Annotated[Optional[int], typer.Option("--gpus-per-node", help="GPUs per NVLink domain.")]
IntraBwOpt = Annotated[Optional[float], typer.Option("--intra-node-bw", help="Intra-node GB/s per GPU per direction.")]
InterBwOpt = Annotated[Optional[float], typer.Option("--inter-node-bw", help="Inter-node GB/s per GPU per direction.")]
ClusterOpt = Annotated[Optional[str], typer.Option("--cluster", help="Cluster file (YAML or JSON) or a shipped cluster name.")]
def _memory_limit_gb(text: str) -> float:
    """--memory-limit's value in GB (10^9 bytes), the unit the API takes."""
    from costmodels.specs import SpecError, parse_bytes
    try:
        return parse_bytes(text, "memory_limit") / 1e9
    except SpecError as exc:
        raise typer.BadParameter(exc.reason) from None


MemLimitOpt = Annotated[Optional[float], typer.Option(
    "--memory-limit", "--memory-limit-gb", parser=_memory_limit_gb, metavar="SIZE",
    help="Usable memory per GPU: 80GiB, 76GB (a bare number is GB = 10^9 bytes; default: the GPU's HBM).")]
CalibrationOpt = Annotated[Optional[str], typer.Option("--calibration", help="Efficiency-parameter file (default: shipped defaults).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout and nothing else.")]

# Megatron-Core options of the job (FrameworkSpec), with Megatron's flag names; None = its default
FrameworkOpt = Annotated[Optional[str], typer.Option("--framework", help="megatron (default), deepspeed (ZeRO-2 exists only there) or jax (an XLA-compiled step: MaxText, the jax runner).")]
AttentionBackendOpt = Annotated[Optional[str], typer.Option("--attention-backend", help="auto (default, Megatron-Core's: Transformer Engine runs cuDNN's fused attention on Hopper / Blackwell, FlashAttention-2 on Ampere), flash (FlashAttention-2: ~0.61x cuDNN's rate on Hopper+), fused (cuDNN) or unfused (s x s scores in memory).")]
TpCommOverlapOpt = Annotated[Optional[bool], typer.Option("--tp-comm-overlap/--no-tp-comm-overlap", help="Megatron --tp-comm-overlap (TE userbuffers; needs SP). Default off.")]
GradReduceBf16Opt = Annotated[Optional[bool], typer.Option("--grad-reduce-in-bf16/--grad-reduce-in-fp32", help="Gradient buffers and their reduction in bf16 (Megatron-Bridge recipes) or fp32 (Megatron-LM default).")]
Fp8ParamGatherOpt = Annotated[Optional[bool], typer.Option("--fp8-param-gather/--no-fp8-param-gather", help="fp8 primary weights and fp8 parameter all-gathers (fp8/fp4 only).")]
DispatcherOpt = Annotated[Optional[str], typer.Option("--moe-token-dispatcher-type", help="alltoall (default here), allgather or flex (DeepEP/HybridEP: a token goes once to each other node and to each rank holding its experts).")]
OverlapGradReduceOpt = Annotated[Optional[bool], typer.Option("--overlap-grad-reduce/--no-overlap-grad-reduce", help="Megatron --overlap-grad-reduce: gradient reduction under the last backward. Default here on (the recipes' setting; Megatron's own default is off).")]
OverlapParamGatherOpt = Annotated[Optional[bool], typer.Option("--overlap-param-gather/--no-overlap-param-gather", help="Megatron --overlap-param-gather (distributed optimizer; needs --overlap-grad-reduce): parameter all-gather under the first forward. Default here on.")]
GradAccFusionOpt = Annotated[Optional[bool], typer.Option("--gradient-accumulation-fusion/--no-gradient-accumulation-fusion", help="Megatron's weight-gradient GEMMs accumulate into the fp32 main gradients (default on; off adds a memory-bound pass per micro-batch, as 2021 Megatron-LM ran; --framework jax and deepspeed default to off: a JAX trainer, and Megatron-DeepSpeed's autograd and DeepSpeed optimizer, add each micro-batch's gradients after its backward pass).")]
MoePermuteFusionOpt = Annotated[Optional[bool], typer.Option("--moe-permute-fusion/--no-moe-permute-fusion", help="Megatron --moe-permute-fusion: Transformer Engine's fused token permute / unpermute (default on here, as the NeMo / Megatron-Bridge MoE recipes run it; Megatron's own default is off: unfused, the tokens' way back is an atomic scatter-add).")]
CrossEntropyFusionOpt = Annotated[Optional[bool], typer.Option("--cross-entropy-loss-fusion/--no-cross-entropy-loss-fusion", help="Megatron --cross-entropy-loss-fusion: the vocab-parallel cross entropy as fused kernels (default on here, as Megatron-Bridge runs it; Megatron's own default is off: PyTorch ops over an fp32 copy of the logits, 52 B per logit).")]
CrossEntropyImplOpt = Annotated[Optional[str], typer.Option("--cross-entropy-fusion-impl", help="native (Megatron-Core's jit-fused, default) or te (Transformer Engine's kernels: no fp32 copy of the logits; Megatron-Bridge's performance scripts; Megatron-LM's own arguments refuse it).")]
EpOverlapOpt = Annotated[Optional[bool], typer.Option("--overlap-moe-expert-parallel-comm/--no-overlap-moe-expert-parallel-comm", help="Megatron's batch-level EP overlap: each micro-batch's all-to-alls under another's compute (needs ep > 1, vpp > 1 with pp). Default off.")]

CudaGraphImplOpt = Annotated[Optional[str], typer.Option("--cuda-graph-impl", help="Megatron CUDA graphs: none (default), "
                             "local, transformer_engine (per-layer graphs) or full_iteration (the whole forward-backward).")]
Fp8RecipeOpt = Annotated[Optional[str], typer.Option(
    "--fp8-recipe", help="With --precision fp8: delayed (Megatron's default), tensorwise (current scaling: an "
                         "amax pass per cast), mxfp8 (Blackwell only) or blockwise (Hopper and Blackwell).")]
Fp8AttentionOpt = Annotated[Optional[bool], typer.Option(
    "--fp8-dot-product-attention/--no-fp8-dot-product-attention",
    help="With --precision fp8 and --attention-backend fused: Transformer Engine's fp8 attention on cuDNN "
         "(Megatron-Core's fp8_dot_product_attention; delayed on Hopper / Blackwell, tensorwise and mxfp8 on "
         "Blackwell). Default off.")]
LoraDimOpt = Annotated[Optional[int], typer.Option(
    "--lora-dim", metavar="N",
    help="LoRA fine-tuning (Megatron-Bridge peft=LoRA(dim=N), N = 32 its default): rank-N adapters on every "
         "attention and MLP linear train, the base weights stay frozen (no weight gradients, optimizer states or "
         "gradient reduction for them). Default 0: every weight trains.")]
PackedExampleTokensOpt = Annotated[Optional[int], typer.Option(
    "--packed-example-tokens", metavar="N",
    help="Sequence packing (Megatron-Bridge packed_sequence_specs, NeMo's packed fine-tuning data): examples of N "
         "tokens on average are packed into each sequence and attention stays inside each example (Transformer "
         "Engine's THD layout), so a query attends to ~N/2 keys instead of seq/2. Default 0: one document per "
         "sequence.")]
MtpNumLayersOpt = Annotated[Optional[int], typer.Option(
    "--mtp-num-layers", metavar="N",
    help="Multi-token prediction modules (Megatron --mtp-num-layers): N more layers on the last pipeline rank, "
         "each with a second pass through the output layer and a loss. Default: the model config's "
         "num_nextn_predict_layers (DeepSeek-V3: 1); 0 trains without MTP.")]
CpuOffloadingOpt = Annotated[Optional[int], typer.Option(
    "--cpu-offloading-num-layers", metavar="N",
    help="Activation CPU offloading (Megatron --cpu-offloading-num-layers): the activations of N transformer layers "
         "go to host memory after their forward and come back for their backward, over PCIe or NVLink-C2C. "
         "Megatron-Core allows it without pipeline parallelism and recomputation only, so the search keeps to pp=1 "
         "and recompute=none. Default 0: off.")]
LoraModulesOpt = Annotated[Optional[list[str]], typer.Option(
    "--lora-target-modules", metavar="MODULES",
    help="With --lora-dim: the linears that get adapters, of linear_qkv, linear_proj, linear_fc1, linear_fc2 "
         "(comma-separated or repeated; default all four, Megatron-Bridge's LoRA default; NeMo 1's names "
         "attention_qkv, attention_dense, mlp_fc1, mlp_fc2 are accepted).")]
CudaGraphModulesOpt = Annotated[Optional[list[str]], typer.Option(
    "--cuda-graph-modules", "--cuda-graph-scope", metavar="MODULES",
    help="Regions per-layer graphs capture: attn, mlp, moe, moe_router, moe_preprocess (comma-separated or repeated; "
         "none = the whole layer). --cuda-graph-scope is Megatron's older name.")]


#: the framework flags of a command, by parameter name (the Opt types above); framework_options_of reads them
FRAMEWORK_FLAGS = ("framework", "attention_backend", "tp_comm_overlap", "grad_reduce_in_bf16", "fp8_param_gather",
                   "moe_token_dispatcher_type", "cuda_graph_impl", "cuda_graph_modules",
                   "overlap_moe_expert_parallel_comm", "overlap_grad_reduce", "overlap_param_gather",
                   "gradient_accumulation_fusion", "moe_permute_fusion", "cross_entropy_loss_fusion",
                   "cross_entropy_fusion_impl", "fp8_recipe", "fp8_dot_product_attention", "lora_dim",
                   "lora_target_modules", "packed_example_tokens", "mtp_num_layers", "cpu_offloading_num_layers")


def framework_options_of(values: dict) -> dict:
    """framework_options from a command's parameters (its `locals()`): one call for every command."""
    return framework_options(**{k: values.get(k) for k in FRAMEWORK_FLAGS})


def framework_options(framework, attention_backend, tp_comm_overlap, grad_reduce_in_bf16, fp8_param_gather,
                      moe_token_dispatcher_type, cuda_graph_impl=None, cuda_graph_modules=None,
                      overlap_moe_expert_parallel_comm=None, overlap_grad_reduce=None,
                      overlap_param_gather=None, gradient_accumulation_fusion=None, moe_permute_fusion=None,
                      cross_entropy_loss_fusion=None, cross_entropy_fusion_impl=None, fp8_recipe=None,
                      fp8_dot_product_attention=None, lora_dim=None,
                      lora_target_modules=None, packed_example_tokens=None, mtp_num_layers=None,
                      cpu_offloading_num_layers=None) -> dict:
    """The framework flags as `api.build_problem(framework=...)` takes them."""
    return {"framework": framework, "attention_backend": attention_backend, "tp_comm_overlap": tp_comm_overlap,
            "grad_reduce_in_fp32": None if grad_reduce_in_bf16 is None else not grad_reduce_in_bf16,
            "fp8_param_gather": fp8_param_gather, "moe_token_dispatcher_type": moe_token_dispatcher_type,
            "cuda_graph_impl": cuda_graph_impl, "cuda_graph_modules": cuda_graph_modules,
            "overlap_moe_expert_parallel_comm": overlap_moe_expert_parallel_comm,
            "overlap_grad_reduce": overlap_grad_reduce, "overlap_param_gather": overlap_param_gather,
            "gradient_accumulation_fusion": gradient_accumulation_fusion, "moe_permute_fusion": moe_permute_fusion,
            "cross_entropy_loss_fusion": cross_entropy_loss_fusion,
            "cross_entropy_fusion_impl": cross_entropy_fusion_impl, "fp8_recipe": fp8_recipe,
            "fp8_dot_product_attention": fp8_dot_product_attention, "lora_dim": lora_dim,
            "lora_target_modules": lora_target_modules, "packed_example_tokens": packed_example_tokens,
            "mtp_num_layers": mtp_num_layers, "cpu_offloading_num_layers": cpu_offloading_num_layers}
