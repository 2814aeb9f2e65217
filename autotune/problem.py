"""A problem from user-level names (model preset or config.json, GPU preset or cluster file, job),
and a plan from its text. Below `api` and the search modules, so the search
can rebuild a problem (a study's worker, each GPU count of a range) without importing the facade."""
from __future__ import annotations

import dataclasses

from costmodels.plan import Plan, parse_plan_text
from costmodels.presets import build_cluster, load_model
from costmodels.specs import (AttentionBackend, CrossEntropyImpl, CudaGraphImpl, DispatcherType, Fp8Recipe, Framework,
                              FrameworkSpec, JobSpec, ModelSpec, PipelineSchedule, Precision, SpecError,
                              parse_cuda_graph_modules, parse_lora_modules)
from search_spaces.space import Problem, check_plan, complete_plan

#: default tokens per optimizer step when --global-batch is omitted (Llama 3 / GPT-3 scale: ~4M)
DEFAULT_TOKENS_PER_STEP = 4 * 1024 * 1024


def build_problem(*, model: str, gpu: str | None = None, gpus: int | None = None,
                  global_batch: int | None = None, seq_len: int | None = None,
                  precision: str = "bf16", gpus_per_node: int | None = None,
                  intra_node_bw: float | None = None, inter_node_bw: float | None = None,
                  cluster_file: str | None = None, framework: dict | FrameworkSpec | None = None) -> Problem:
    """Model preset or config.json + GPU preset (+ overrides or cluster file) + job -> Problem.

    `framework` holds Megatron-Core options (FrameworkSpec field names; values may be the CLI's
    strings); omitted ones keep Megatron's defaults."""
    spec = load_model(model)
    if isinstance(framework, dict) and "mtp_num_layers" in framework:
        # Megatron's --mtp-num-layers: the model's MTP modules as launched (None: its config's
        # num_nextn_predict_layers)
        framework = dict(framework)
        mtp = framework.pop("mtp_num_layers")
        if mtp is not None:
            spec = with_mtp_layers(spec, mtp)
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
    fw = framework if isinstance(framework, FrameworkSpec) else framework_spec(**(framework or {}))
    job = JobSpec(global_batch=global_batch, seq_len=seq, precision=prec, framework=fw)
    return Problem(spec, cluster, job)


def with_mtp_layers(spec, n, field_name: str = "mtp_num_layers") -> ModelSpec:
    """The model with n multi-token-prediction modules (--mtp-num-layers, a validation row's model field)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise SpecError(field_name, f"must be a whole number, got {n!r}")
    return dataclasses.replace(spec, mtp_num_layers=n)


def framework_spec(*, framework: str | None = None, attention_backend: str | None = None,
                   tp_comm_overlap: bool | None = None, grad_reduce_in_fp32: bool | None = None,
                   fp8_param_gather: bool | None = None, overlap_grad_reduce: bool | None = None,
                   overlap_param_gather: bool | None = None,
                   moe_token_dispatcher_type: str | None = None,
                   pipeline_schedule: str | None = None,
                   microbatch_grad_buffer: bool | None = None,
                   moe_expert_capacity_factor: float | None = None,
                   cuda_graph_impl: str | None = None,
                   cuda_graph_modules: list | tuple | str | None = None,
                   overlap_moe_expert_parallel_comm: bool | None = None,
                   gradient_accumulation_fusion: bool | None = None,
                   async_tensor_model_parallel_allreduce: bool | None = None,
                   moe_permute_fusion: bool | None = None,
                   cross_entropy_loss_fusion: bool | None = None,
                   cross_entropy_fusion_impl: str | None = None,
                   fp8_recipe: str | None = None,
                   fp8_dot_product_attention: bool | None = None,
                   lora_dim: int | None = None,
                   lora_target_modules: list | tuple | str | None = None,
                   packed_example_tokens: int | None = None,
                   cpu_offloading_num_layers: int | None = None) -> FrameworkSpec:
    """A FrameworkSpec from option values (None = Megatron-Core's default); strings parsed once here."""
    given = {k: v for k, v in dict(tp_comm_overlap=tp_comm_overlap, grad_reduce_in_fp32=grad_reduce_in_fp32,
                                   fp8_param_gather=fp8_param_gather, overlap_grad_reduce=overlap_grad_reduce,
                                   overlap_param_gather=overlap_param_gather,
                                   microbatch_grad_buffer=microbatch_grad_buffer,
                                   moe_expert_capacity_factor=moe_expert_capacity_factor,
                                   overlap_moe_expert_parallel_comm=overlap_moe_expert_parallel_comm,
                                   gradient_accumulation_fusion=gradient_accumulation_fusion,
                                   async_tensor_model_parallel_allreduce=async_tensor_model_parallel_allreduce,
                                   moe_permute_fusion=moe_permute_fusion,
                                   cross_entropy_loss_fusion=cross_entropy_loss_fusion,
                                   fp8_dot_product_attention=fp8_dot_product_attention,
                                   lora_dim=lora_dim, packed_example_tokens=packed_example_tokens,
                                   cpu_offloading_num_layers=cpu_offloading_num_layers).items()
             if v is not None}
    if framework is not None:
        given["framework"] = Framework.parse(framework)
        if grad_reduce_in_fp32 is None:
            given["grad_reduce_in_fp32"] = given["framework"].grad_reduce_in_fp32_default
        if gradient_accumulation_fusion is None:
            given["gradient_accumulation_fusion"] = given["framework"].gradient_accumulation_fusion_default
    if attention_backend is not None:
        given["attention_backend"] = AttentionBackend.parse(attention_backend)
    if moe_token_dispatcher_type is not None:
        given["moe_token_dispatcher_type"] = DispatcherType.parse(moe_token_dispatcher_type)
    if pipeline_schedule is not None:
        given["pipeline_schedule"] = PipelineSchedule.parse(pipeline_schedule)
    if cross_entropy_fusion_impl is not None:
        given["cross_entropy_fusion_impl"] = CrossEntropyImpl.parse(cross_entropy_fusion_impl)
    if fp8_recipe is not None:
        given["fp8_recipe"] = Fp8Recipe.parse(fp8_recipe)
    if lora_target_modules:
        mods = [lora_target_modules] if isinstance(lora_target_modules, str) else lora_target_modules
        given["lora_target_modules"] = parse_lora_modules(mods)
        if not lora_dim:
            raise SpecError("lora_target_modules", "has no effect without LoRA (every weight trains); add "
                            "--lora-dim N (Megatron-Bridge's default rank is 32)")
    if cuda_graph_impl is not None or cuda_graph_modules:
        impl = CudaGraphImpl.parse(cuda_graph_impl) if cuda_graph_impl is not None else CudaGraphImpl.NONE
        mods = [cuda_graph_modules] if isinstance(cuda_graph_modules, str) else cuda_graph_modules
        given["cuda_graph_modules"], given["cuda_graph_impl"] = parse_cuda_graph_modules(mods, impl)
    return FrameworkSpec(**given)


def plan_from_text(text: str, problem: Problem) -> Plan:
    """Parse --plan, fill omitted knobs with defaults (dp from the GPU count), check legality."""
    plan = complete_plan(parse_plan_text(text), problem)
    check_plan(plan, problem)
    return plan
