"""Typer option types shared by the commands (one definition of each flag)."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

ModelOpt = Annotated[str, typer.Option("--model", help="Model preset name or path to a Hugging Face config.json.")]
GpuOpt = Annotated[Optional[str], typer.Option("--gpu", help="GPU preset (a100-80gb, h100, b200, ...).")]
GpusOpt = Annotated[Optional[int], typer.Option("--gpus", help="Number of GPUs.")]
GlobalBatchOpt = Annotated[Optional[int], typer.Option("--global-batch", help="Global batch in sequences.")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", help="Sequence length in tokens.")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="bf16, fp16, fp8 or fp4.")]
GpusPerNodeOpt = Annotated[Optional[int], typer.Option("--gpus-per-node", help="GPUs per NVLink domain.")]
IntraBwOpt = Annotated[Optional[float], typer.Option("--intra-node-bw", help="Intra-node GB/s per GPU per direction.")]
InterBwOpt = Annotated[Optional[float], typer.Option("--inter-node-bw", help="Inter-node GB/s per GPU per direction.")]
ClusterOpt = Annotated[Optional[str], typer.Option("--cluster", help="Cluster file (YAML or JSON) or a shipped cluster name.")]
MemLimitOpt = Annotated[Optional[float], typer.Option("--memory-limit-gb", help="Usable memory per GPU in GB (default: the GPU's).")]
CalibrationOpt = Annotated[Optional[str], typer.Option("--calibration", help="Efficiency-parameter file (default: shipped defaults).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout and nothing else.")]
