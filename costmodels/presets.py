"""Presets and readers: GPUs, models (preset or Hugging Face config.json) and clusters.

Human units (TFLOP/s, GB, GB/s, ms) appear only in the data files under costmodels/presets/, in
cluster files and in CLI flags; this module converts them to SI (FLOP/s, bytes, bytes/s, s) once.
Every user mistake raises `SpecError` with a one-line message naming the field.

Public API
    GPU_PRESETS, MODEL_PRESETS                 name -> GPUSpec / ModelSpec
    load_gpu(name) -> GPUSpec
    load_model(name_or_path) -> ModelSpec      a preset name, a config.json, or a folder holding one
    model_from_hf_config(cfg, name) -> ModelSpec
    build_cluster(gpu=..., num_gpus=..., ...) -> ClusterSpec
    resolve_cluster_file(name_or_path) -> Path, shipped_cluster_files() -> list[str]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable


from .files import read_mapping
from .specs import ClusterSpec, GPUSpec, ModelSpec, SpecError, check_size

PRESET_DIR = Path(__file__).with_name("presets")
CLUSTER_DIR = PRESET_DIR / "clusters"

TERA = 1e12
GIGA = 1e9
RACK_SCALE_DOMAIN = 8      # NVLink domains larger than a DGX node are racks (NVL72)
GIBI = 2.0 ** 30   # HBM capacities are printed in GB but are binary: an "80 GB" H100 shows 81,559 MiB
MICRO = 1e-6
MILLI = 1e-3


# ---------------------------------------------------------------------------------------------
# Data files
# ---------------------------------------------------------------------------------------------

def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _read_mapping(path: Path, field_name: str) -> dict:
    """Parse a JSON (by suffix) or YAML file whose top level is a mapping (regular files only, size-
    bounded, YAML without aliases, duplicate keys refused: `costmodels.files`)."""
    return read_mapping(path, field_name, shipped=Path(path).resolve().is_relative_to(PRESET_DIR.resolve()))


# ---------------------------------------------------------------------------------------------
# GPUs
# ---------------------------------------------------------------------------------------------

#: GPUSpec field -> (key in presets/gpus.yaml, factor from the file's unit to SI).
_GPU_FILE_FIELDS = {
    "peak_flops_bf16": ("bf16_tflops", TERA),
    "peak_flops_fp8": ("fp8_tflops", TERA),
    "peak_flops_fp4": ("fp4_tflops", TERA),
    "hbm_bytes": ("hbm_gb", GIBI),
    "hbm_bandwidth_bytes_per_s": ("hbm_tbps", TERA),
    "intra_node_bw_bytes_per_s": ("nvlink_gbps", GIGA),
    "inter_node_bw_bytes_per_s": ("nic_gbps", GIGA),
}


def _gpu_from_entry(name: str, entry: dict) -> GPUSpec:
    # Rounded to whole SI units: 1.555 TB/s * 1e12 is 1555000000000.0002 in floating point.
    si = {f: float(round(entry[key] * factor)) for f, (key, factor) in _GPU_FILE_FIELDS.items()}
    if entry.get("p2p_gbps"):                        # fully connected meshes: one link per peer
        si["intra_node_p2p_bw_bytes_per_s"] = float(round(entry["p2p_gbps"] * GIGA))
    for prec in ("bf16", "fp8", "fp4"):                 # measured max-achievable matmul fractions
        if entry.get(f"mamf_{prec}_frac") is not None:
            si[f"matmul_frac_{prec}"] = float(entry[f"mamf_{prec}_frac"])
    if entry.get("sms") is not None:                   # SMs (AMD: CUs) and their boost clock
        si["sm_count"] = int(entry["sms"])
        si["sm_clock_hz"] = float(round(entry["sm_clock_mhz"] * 1e6))
    if entry.get("exp_throughput_x") is not None:      # softmax exponential rate (2: Blackwell Ultra)
        si["exp_throughput_x"] = float(entry["exp_throughput_x"])
    if entry.get("host_op_x") is not None:             # the host CPU's time per framework op (Grace: 2.75)
        si["host_op_x"] = float(entry["host_op_x"])
    if entry.get("host_gbps") is not None:             # the link to host memory (CPU offloading's copies)
        si["host_link_bw_bytes_per_s"] = float(round(entry["host_gbps"] * GIGA))
    return GPUSpec(name=name, family=entry["family"], gpus_per_node=entry["gpus_per_node"],
                   source=_one_line(entry["source"]), **si)


#: GPU presets, keyed by the name used on the CLI and in cluster files (also the GPUSpec name).
GPU_PRESETS: dict[str, GPUSpec] = {
    name: _gpu_from_entry(name, entry)
    for name, entry in _read_mapping(PRESET_DIR / "gpus.yaml", "gpu").items()
}


#: Other names users type for a preset (the H100 preset is the 80 GB SXM part; a100-80gb exists,
#: so h100-80gb is the name people try first). Resolved to the preset, whose name is kept.
GPU_ALIASES: dict[str, str] = {"h100-80gb": "h100", "h100-sxm": "h100", "h100-sxm5": "h100",
                               "h200-141gb": "h200", "b200-180gb": "b200"}


def _gpu(name, field_name: str) -> GPUSpec:
    key = str(name).strip().lower()
    key = GPU_ALIASES.get(key, key)
    if key not in GPU_PRESETS:
        raise SpecError(field_name, f"unknown GPU preset {name!r}; known presets: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[key]


def load_gpu(name: str) -> GPUSpec:
    """The GPU preset `name` (case-insensitive)."""
    return _gpu(name, "gpu")


# ---------------------------------------------------------------------------------------------
# Models: Hugging Face config.json
# ---------------------------------------------------------------------------------------------

_REQUIRED = object()
_BOOL_FIELDS = frozenset({"tied_embeddings", "gated_mlp"})
_MOE_FIELDS = ("num_experts", "experts_per_token", "moe_ffn_hidden_size", "num_shared_experts",
               "shared_expert_ffn_hidden_size", "first_k_dense_layers", "moe_layer_freq", "expert_bias")

# A key table maps each ModelSpec field to (config.json key or keys, the first present wins;
# default). A default is _REQUIRED, a value, or a function of the fields read so far. A key of ()
# means the field is derived from other fields only. A null value in config.json counts as absent;
# a field whose value ends up None is left to ModelSpec's default.
_KeyTable = dict[str, tuple[tuple[str, ...], object]]

# LlamaConfig / MistralConfig / Qwen2Config (transformers) key names and defaults.
_DECODER: _KeyTable = {
    "num_layers": (("num_hidden_layers",), _REQUIRED),
    "hidden_size": (("hidden_size",), _REQUIRED),
    "ffn_hidden_size": (("intermediate_size",), _REQUIRED),
    "num_attention_heads": (("num_attention_heads",), _REQUIRED),
    "num_kv_heads": (("num_key_value_heads",), lambda f: f["num_attention_heads"]),  # absent: MHA
    "vocab_size": (("vocab_size",), _REQUIRED),
    "head_dim": (("head_dim",), None),                 # absent: hidden_size / num_attention_heads
    "tied_embeddings": (("tie_word_embeddings",), False),
    "max_seq_len": (("max_position_embeddings",), None),
}

# MistralConfig: as Llama, plus sliding_window (4096 in Mistral-7B-v0.1, null from v0.2 on).
_MISTRAL: _KeyTable = _DECODER | {"sliding_window": (("sliding_window",), 0)}

# GemmaConfig / Gemma2Config / Gemma3TextConfig: gated GeLU MLP (3 matrices), tied embeddings
# unless the config says otherwise. Gemma-3's published config.json lists only the keys that differ
# from Gemma3TextConfig's defaults (transformers configuration_gemma3.py), so those defaults apply.
_GEMMA: _KeyTable = _DECODER | {"tied_embeddings": (("tie_word_embeddings",), True),
                                "sliding_window": (("sliding_window",), 0)}
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                         "head_dim": 256, "max_position_embeddings": 131_072, "sliding_window": 4096}

# GPT2Config: learned positions, GeLU MLP (2 matrices), input and output embeddings always tied.
_GPT2: _KeyTable = {
    "num_layers": (("n_layer",), _REQUIRED),
    "hidden_size": (("n_embd",), _REQUIRED),
    "ffn_hidden_size": (("n_inner",), lambda f: 4 * f["hidden_size"]),   # GPT2Config: None = 4 * n_embd
    "num_attention_heads": (("n_head",), _REQUIRED),
    "num_kv_heads": (("n_head",), _REQUIRED),
    "vocab_size": (("vocab_size",), _REQUIRED),
    "max_seq_len": (("n_positions",), None),
}

# MixtralConfig: every layer is MoE; intermediate_size is the size of each expert.
_MIXTRAL: _KeyTable = _DECODER | {
    "num_experts": (("num_local_experts",), _REQUIRED),
    "experts_per_token": (("num_experts_per_tok",), _REQUIRED),
    "moe_ffn_hidden_size": (("intermediate_size",), _REQUIRED),
}

# GptOssConfig: as Mixtral; the Hub's config.json spells top-k both ways; a 128-token sliding window
# (GptOssConfig's default) on alternate layers.
_GPT_OSS: _KeyTable = _MIXTRAL | {
    "experts_per_token": (("num_experts_per_tok", "experts_per_token"), _REQUIRED),
    "sliding_window": (("sliding_window",), 128),
}

# Qwen2MoeConfig / Qwen3MoeConfig: intermediate_size is the dense MLP of mlp_only_layers; a
# shared expert of shared_expert_intermediate_size (Qwen2-MoE; absent in Qwen3-MoE).
_QWEN_MOE: _KeyTable = _DECODER | {
    "num_experts": (("num_experts",), _REQUIRED),
    "experts_per_token": (("num_experts_per_tok",), _REQUIRED),
    "moe_ffn_hidden_size": (("moe_intermediate_size",), _REQUIRED),
    "shared_expert_ffn_hidden_size": (("shared_expert_intermediate_size",), 0),
    "num_shared_experts": ((), lambda f: 1 if f["shared_expert_ffn_hidden_size"] > 0 else 0),
}

# DeepseekV2Config / DeepseekV3Config: multi-head latent attention (MLA) and fine-grained experts;
# intermediate_size is the dense MLP of the first_k_dense_replace layers, n_shared_experts
# experts of moe_intermediate_size each. n_routed_experts null = a dense model.
_DEEPSEEK: _KeyTable = _DECODER | {
    # MLA up-projects one K and V per attention head, so K/V heads = attention heads.
    "num_kv_heads": (("num_attention_heads",), _REQUIRED),
    "num_experts": (("n_routed_experts",), 0),
    "experts_per_token": (("num_experts_per_tok",), 0),
    "moe_ffn_hidden_size": (("moe_intermediate_size",), 0),
    "num_shared_experts": (("n_shared_experts",), 0),
    "q_lora_rank": (("q_lora_rank",), 0),              # null: full-rank query (DeepSeek-V2-Lite)
    "kv_lora_rank": (("kv_lora_rank",), _REQUIRED),
    "qk_nope_head_dim": (("qk_nope_head_dim",), _REQUIRED),
    "qk_rope_head_dim": (("qk_rope_head_dim",), _REQUIRED),
    "v_head_dim": (("v_head_dim",), _REQUIRED),
    # DeepseekV3Config: MTP modules (DeepSeek-V3 trains with 1; absent in V2)
    "mtp_num_layers": (("num_nextn_predict_layers",), 0),
}


# Which layers are MoE. `get(key, default, kind, minimum)` reads and checks a config.json key.

def _qwen_moe_layer(i: int, get) -> bool:
    # transformers Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer: sparse iff
    # i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    return (i not in get("mlp_only_layers", [], list, 0)
            and (i + 1) % get("decoder_sparse_step", 1, int, 1) == 0)


def _deepseek_moe_layer(i: int, get) -> bool:
    # modeling_deepseek.py DeepseekV2/V3DecoderLayer: MoE iff
    # i >= first_k_dense_replace and i % moe_layer_freq == 0.
    return (i >= get("first_k_dense_replace", 0, int, 0)
            and i % get("moe_layer_freq", 1, int, 1) == 0)


# Which layers use the sliding window when config.json has no `layer_types` list (transformers'
# default layer_types of each config class); a family without one: every layer (Mistral).

def _alternate_sliding_layer(i: int, get) -> bool:
    # Gemma2Config / GptOssConfig: "sliding_attention" if bool((i + 1) % 2) else "full_attention"
    return bool((i + 1) % 2)


def _gemma3_sliding_layer(i: int, get) -> bool:
    # Gemma3TextConfig: "sliding_attention" if bool((i + 1) % sliding_window_pattern), pattern 6
    return bool((i + 1) % get("sliding_window_pattern", 6, int, 1))


@dataclass(frozen=True)
class _Family:
    keys: _KeyTable
    fixed: dict = field(default_factory=dict)            # ModelSpec fields set for the whole family
    moe_layer: Callable | None = None                    # (layer, get) -> is MoE; None: all layers
    sliding_layer: Callable | None = None                # (layer, get) -> uses the window; None: all layers


_FAMILIES: dict[str, _Family] = {
    "gpt2": _Family(_GPT2, fixed={"gated_mlp": False, "tied_embeddings": True,
                                  "position_embedding": "learned_absolute"}),
    "llama": _Family(_DECODER),
    "mistral": _Family(_MISTRAL),
    "gemma": _Family(_GEMMA),
    "gemma2": _Family(_GEMMA, sliding_layer=_alternate_sliding_layer),
    "gemma3_text": _Family(_GEMMA, sliding_layer=_gemma3_sliding_layer),
    "qwen2": _Family(_DECODER),
    "qwen3": _Family(_DECODER),
    "mixtral": _Family(_MIXTRAL),
    "qwen2_moe": _Family(_QWEN_MOE, moe_layer=_qwen_moe_layer),
    "qwen3_moe": _Family(_QWEN_MOE, moe_layer=_qwen_moe_layer),
    "deepseek_v2": _Family(_DEEPSEEK, moe_layer=_deepseek_moe_layer),
    "deepseek_v3": _Family(_DEEPSEEK, moe_layer=_deepseek_moe_layer),
    # GptOssConfig: experts with biases (GptOssExperts' gate_up_proj_bias, down_proj_bias; the Bridge provider's
    # add_bias_linear), attention sinks (GptOssAttention.sinks, a learnable logit per head: Megatron-Core's
    # softmax_type="learnable") and a quick GeGLU, (up + 1) * gate * sigmoid(1.702 gate), clamped at swiglu_limit
    "gpt_oss": _Family(_GPT_OSS, fixed={"expert_bias": True, "attention_sinks": True, "glu_activation": "quick_gelu",
                                        "glu_linear_offset": 1.0},
                       sliding_layer=_alternate_sliding_layer),
}

SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)


def _check_type(where: str, key: str, value, kind: type):
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is list:
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ok:
        wanted = {bool: "true or false", int: "an integer", list: "a list of integers"}[kind]
        raise SpecError("model", f"{where}: '{key}' must be {wanted}, got {value!r}")
    return value


def _read_fields(cfg: dict, table: _KeyTable, where: str) -> dict:
    out: dict = {}
    for name, (keys, default) in table.items():
        key, value = next(((k, cfg[k]) for k in keys if cfg.get(k) is not None), (None, None))
        if key is None:
            if default is _REQUIRED:
                raise SpecError("model", f"{where} is missing key '{keys[0]}'")
            value = default(out) if callable(default) else default
        else:
            value = _check_type(where, key, value, bool if name in _BOOL_FIELDS else int)
        if value is not None:
            out[name] = value
    return out


def _moe_layout(moe_layers: list[int], num_layers: int, where: str) -> dict:
    """ModelSpec's layout (first_k_dense_layers, then every moe_layer_freq-th layer) of a set of
    MoE layer indices; an error if the set has another shape."""
    first = moe_layers[0]
    freq = moe_layers[1] - first if len(moe_layers) > 1 else max(num_layers - first, 1)
    if moe_layers != list(range(first, num_layers, freq)):
        raise SpecError("model", f"{where}: MoE layers {moe_layers} are not leading dense layers "
                        "followed by every n-th layer, which is all ModelSpec can describe")
    return {"first_k_dense_layers": first, "moe_layer_freq": freq}


def model_from_hf_config(cfg: dict, name: str, *, source: str = "") -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json dict; `source` (a path or URL) is recorded in the
    spec and named in error messages."""
    origin = source or "config.json"
    if not isinstance(cfg, dict):
        raise SpecError("model", f"{origin} must hold a JSON object, got {type(cfg).__name__}")
    cfg = _text_config(cfg, origin)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        got = f"model_type {model_type!r} is not supported" if model_type else "has no 'model_type'"
        raise SpecError("model", f"{origin} {got}; supported model types: {', '.join(_FAMILIES)}")
    family = _FAMILIES[model_type]
    where = f"{origin} (model_type {model_type})"
    fields_ = _read_fields(cfg, family.keys, where) | family.fixed
    for key, value in fields_.items():              # before any loop over layers
        check_size(key, value, "model")

    def get(key, default, kind, minimum):
        value = cfg.get(key)
        if value is None:
            return default
        _check_type(where, key, value, kind)
        if min([value] if kind is int else value, default=minimum) < minimum:
            raise SpecError("model", f"{where}: '{key}' must be >= {minimum}, got {value!r}")
        return value

    if fields_.get("num_experts", 0) > 0 and family.moe_layer is not None:
        moe = [i for i in range(fields_["num_layers"]) if family.moe_layer(i, get)]
        fields_ |= _moe_layout(moe, fields_["num_layers"], where) if moe else {"num_experts": 0}
    if fields_.get("sliding_window", 0) > 0:
        fields_["sliding_window_layers"] = _sliding_window_layers(cfg, family, fields_["num_layers"], get, where)
    if _rope_type(cfg, where) == "yarn" and not fields_.get("kv_lora_rank"):
        # Megatron builds YaRN as its own position embedding (Megatron-Bridge's GPT-OSS provider:
        # position_embedding_type="yarn"); MLA models (DeepSeek) apply YaRN inside plain "rope"
        fields_["position_embedding"] = "yarn"
    if fields_.get("num_experts", 0) == 0:               # dense: drop MoE fields a config may carry
        fields_ = {k: v for k, v in fields_.items() if k not in _MOE_FIELDS}
    fields_["hidden_dropout"] = _dropout(cfg, model_type, where)
    if model_type == "gpt_oss":          # its GLU's clamp (GptOssConfig.swiglu_limit, 7.0 by default)
        limit = cfg.get("swiglu_limit", 7.0)
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 <= limit < 1e6:
            raise SpecError("model", f"{where}: 'swiglu_limit' must be a number >= 0, got {limit!r}")
        fields_["activation_clamp"] = float(limit)
    return ModelSpec(name=name, source=source, **fields_)


def _rope_type(cfg: dict, where: str) -> str:
    """config.json's rope_scaling type ('rope_type', older files 'type'); GptOssConfig's default is YaRN."""
    scaling = cfg.get("rope_scaling")
    if scaling is None and cfg.get("model_type") == "gpt_oss":
        return "yarn"
    if scaling is None:
        return ""
    if not isinstance(scaling, dict):            # "yarn" or [..] was read as plain RoPE, silently
        raise SpecError("model", f"{where}: 'rope_scaling' must be a JSON object or null, got {scaling!r:.60}")
    kind = scaling.get("rope_type", scaling.get("type"))
    return kind if isinstance(kind, str) else ""


def _sliding_window_layers(cfg: dict, family: _Family, num_layers: int, get, where: str) -> int:
    """How many layers use the sliding window: config.json's `layer_types` ("sliding_attention" /
    "full_attention" per layer) where given, else the family's default pattern, else every layer."""
    types = cfg.get("layer_types")
    if types is not None:
        kinds = ("sliding_attention", "full_attention")
        if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
            raise SpecError("model", f"{where}: 'layer_types' must list {num_layers} entries, each "
                            f"'sliding_attention' or 'full_attention'")
        return types.count("sliding_attention")
    if family.sliding_layer is None:
        return num_layers
    return sum(bool(family.sliding_layer(i, get)) for i in range(num_layers))


def _dropout(cfg: dict, model_type: str, where: str) -> float:
    """Residual (hidden) dropout: GPT-2's resid_pdrop (transformers' default 0.1), else
    hidden_dropout (absent in Llama-style configs: no dropout)."""
    key, default = ("resid_pdrop", 0.1) if model_type == "gpt2" else ("hidden_dropout", 0.0)
    value = cfg.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise SpecError("model", f"{where}: '{key}' must be a probability in [0, 1), got {value!r}")
    return float(value)


def _text_config(cfg: dict, origin: str) -> dict:
    """The language model's config of a multimodal config.json (Gemma-3, ...: a nested
    `text_config`), with the defaults of its config class where the file omits keys."""
    if cfg.get("model_type") in _FAMILIES or cfg.get("text_config") is None:
        return cfg
    if not isinstance(cfg["text_config"], dict):
        raise SpecError("model", f"{origin}: 'text_config' must be a JSON object, got {cfg['text_config']!r:.60}")
    text = cfg["text_config"]
    kind = text.get("model_type") or (f"{cfg['model_type']}_text" if isinstance(cfg.get("model_type"), str) else None)
    if kind == "gemma3_text":
        return _GEMMA3_TEXT_DEFAULTS | {k: v for k, v in text.items() if v is not None} | {"model_type": kind}
    if kind not in _FAMILIES:
        raise SpecError("model", f"{origin}: the text_config model_type {kind!r} is not supported; supported "
                        f"model types: {', '.join(_FAMILIES)}")
    return text | {"model_type": kind}


def _model_name_from_path(path: Path) -> str:
    return path.parent.name if path.name == "config.json" and path.parent.name else path.stem


def _looks_like_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.lower().endswith((".json", ".yaml", ".yml"))


def _model_from_file(path: Path) -> ModelSpec:
    cfg = _read_mapping(path, "model")
    return model_from_hf_config(cfg, _model_name_from_path(path), source=str(path))


#: Model presets: verbatim subsets of each model's published config.json (presets/models.yaml).
MODEL_PRESETS: dict[str, ModelSpec] = {
    name: model_from_hf_config(entry["config"], name, source=_one_line(entry["source"]))
    for name, entry in _read_mapping(PRESET_DIR / "models.yaml", "model").items()
}


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name (case-insensitive), a path to a config.json, or a folder holding one."""
    text = str(name_or_path).strip()
    if text.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[text.lower()]
    if not text:
        raise SpecError("model", f"give a preset or a config.json; known presets: {', '.join(MODEL_PRESETS)}")
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.exists() or _looks_like_path(text):
        return _model_from_file(path)
    raise SpecError("model", f"unknown preset {text!r}; known presets: {', '.join(MODEL_PRESETS)}")


# ---------------------------------------------------------------------------------------------
# Clusters
# ---------------------------------------------------------------------------------------------

_CLUSTER_FIELDS = ("name", "gpu", "gpus", "gpus_per_node", "nvlink_domain_size",
                   "intra_node_bandwidth_gb_per_s", "inter_node_bandwidth_gb_per_s", "fabric_bandwidth_factor",
                   "intra_node_latency_us", "inter_node_latency_us", "host_op_x", "sites")
_SITE_FIELDS = ("count", "gpus_per_site", "wan_bandwidth_gb_per_s", "wan_latency_ms")
#: earlier names of the bandwidth fields: "gbps" read as GB/s, which most readers take for Gb/s
_OLD_BANDWIDTH_KEYS = {"intra_node_bandwidth_gbps": "intra_node_bandwidth_gb_per_s",
                       "inter_node_bandwidth_gbps": "inter_node_bandwidth_gb_per_s",
                       "wan_bandwidth_gbps": "wan_bandwidth_gb_per_s"}


def _renamed(data: dict, prefix: str) -> dict:
    """The file's fields with the old *_gbps names read as their *_gb_per_s successors (both: an error)."""
    out = dict(data)
    for old, new in _OLD_BANDWIDTH_KEYS.items():
        if old in out:
            if new in out:
                raise SpecError(f"{prefix}.{old}", f"give {new} only (GB/s; {old} is its old name)")
            out[new] = out.pop(old)
    return out


def shipped_cluster_files() -> list[str]:
    """Names of the example cluster files shipped in costmodels/presets/clusters/."""
    return sorted(p.name for p in CLUSTER_DIR.glob("*") if p.suffix in (".yaml", ".yml", ".json"))


def resolve_cluster_file(name_or_path: str) -> Path:
    """A path to an existing file, or the bare name of a shipped one ("nvl72.yaml" or "nvl72")."""
    text = str(name_or_path).strip()
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if path.name == text:                                  # a bare name: look among shipped files
        for candidate in (CLUSTER_DIR / text, CLUSTER_DIR / f"{text}.yaml"):
            if candidate.is_file():
                return candidate
    raise SpecError("cluster_file", f"no such file {text!r}; shipped cluster files: "
                    f"{', '.join(shipped_cluster_files())}")


def _positive_int(field_name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(field_name, f"must be a positive integer, got {value!r}")
    size = {"count": "num_sites", "gpus_per_site": "gpus"}.get(field_name.rsplit(".", 1)[-1],
                                                               field_name.rsplit(".", 1)[-1])
    check_size(size, value, field_name)
    return value


#: the largest number a cluster file may give (GB/s, us, ms): far above real hardware, small
#: enough that the cost model's float32 arithmetic stays finite
MAX_FILE_NUMBER = 1e9


def _positive_number(field_name: str, value) -> float:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or value <= 0):
        raise SpecError(field_name, f"must be a positive number, got {value!r}")
    if value > MAX_FILE_NUMBER:
        raise SpecError(field_name, f"{value:g} is larger than the supported maximum {MAX_FILE_NUMBER:g}")
    return float(value)


def _check_known(data: dict, known: tuple, prefix: str) -> None:
    for key in data:
        if key not in known:
            raise SpecError(f"{prefix}.{key}", f"unknown field; known fields: {', '.join(known)}")


def _pick(cli_value, cli_field: str, file: dict, *file_keys: str):
    """(value, field name) from the CLI if given, else from the cluster file, else (None, None)."""
    if cli_value is not None:
        return cli_value, cli_field
    for key in file_keys:
        if file.get(key) is not None:
            return file[key], f"cluster.{key}"
    return None, None


#: the bandwidths accepted, GB/s per GPU per direction: 1 MB/s (a step would take years below it)
#: to 1 PB/s (1,000x any link today)
BW_RANGE_GBPS = (1e-3, 1e6)


def _bandwidth(cli_gbps, cli_field: str, file: dict, file_key: str, default_bytes_per_s: float) -> float:
    """Bytes/s from a GB/s flag or file field, else the GPU preset's default."""
    value, where = _pick(cli_gbps, cli_field, file, file_key)
    if value is None:
        return default_bytes_per_s
    gbps = _positive_number(where, value)
    if not BW_RANGE_GBPS[0] <= gbps <= BW_RANGE_GBPS[1]:
        raise SpecError(where, f"{gbps:g} GB/s is outside the supported range {BW_RANGE_GBPS[0]:g} to "
                        f"{BW_RANGE_GBPS[1]:g} GB/s")
    return gbps * GIGA


def _domain_size(cli_value, file: dict, gpu: GPUSpec) -> tuple[int, str]:
    """The NVLink domain size and where it came from (a field name, or the GPU preset)."""
    a, b = file.get("gpus_per_node"), file.get("nvlink_domain_size")
    if cli_value is None and a is not None and b is not None and a != b:
        raise SpecError("cluster.nvlink_domain_size", f"{b} differs from gpus_per_node={a}; give one of them")
    value, where = _pick(cli_value, "gpus_per_node", file, "nvlink_domain_size", "gpus_per_node")
    if value is None:
        return gpu.gpus_per_node, f"the {gpu.name} preset"
    return _positive_int(where, value), where


def _sites(file: dict, num_gpus: int | None) -> tuple[dict, int | None]:
    """ClusterSpec's site fields from the file's `sites` mapping, and the GPU count they imply."""
    sites = file.get("sites")
    if sites is None:
        return {"num_sites": 1}, None
    if not isinstance(sites, dict):
        raise SpecError("cluster.sites", f"must be a mapping with {', '.join(_SITE_FIELDS)}")
    sites = _renamed(sites, "cluster.sites")
    _check_known(sites, _SITE_FIELDS, "cluster.sites")
    count = _positive_int("cluster.sites.count", sites.get("count"))
    per_site = sites.get("gpus_per_site")
    if per_site is not None:
        per_site = _positive_int("cluster.sites.gpus_per_site", per_site)
        if num_gpus is not None and count * per_site != num_gpus:
            raise SpecError("cluster.sites.gpus_per_site", f"{count} sites x {per_site} GPUs = "
                            f"{count * per_site}, but gpus = {num_gpus}")
    elif num_gpus is not None and num_gpus % count:
        raise SpecError("cluster.sites.count", f"gpus = {num_gpus} does not split evenly over {count} sites")
    out = {"num_sites": count}
    if count > 1:
        out["wan_bw_bytes_per_s"] = _positive_number(
            "cluster.sites.wan_bandwidth_gb_per_s", sites.get("wan_bandwidth_gb_per_s")) * GIGA
        out["wan_latency_s"] = _positive_number(
            "cluster.sites.wan_latency_ms", sites.get("wan_latency_ms")) * MILLI
    return out, (count * per_site if per_site is not None else None)


def build_cluster(*, gpu: str | None = None, num_gpus: int | None = None,
                  gpus_per_node: int | None = None, intra_node_bw_gbps: float | None = None,
                  inter_node_bw_gbps: float | None = None, cluster_file: str | None = None) -> ClusterSpec:
    """A ClusterSpec from CLI flags, a cluster file and the GPU preset, in that order of precedence.

    Bandwidths are GB/s per GPU per direction (the WAN's is per site, aggregate). A cluster smaller
    than one NVLink domain is a partial node: its domain is all of its GPUs.
    """
    file = _read_mapping(resolve_cluster_file(cluster_file), "cluster_file") if cluster_file else {}
    file = _renamed(file, "cluster")
    _check_known(file, _CLUSTER_FIELDS, "cluster")

    gpu_name, gpu_field = _pick(gpu, "gpu", file, "gpu")
    if gpu_name is None:
        raise SpecError("gpu", f"give a GPU preset (--gpu or 'gpu' in the cluster file); known "
                        f"presets: {', '.join(GPU_PRESETS)}")
    gpu_spec = _gpu(gpu_name, gpu_field)
    if file.get("host_op_x") is not None:           # the nodes' CPU, where it is not the preset's usual host
        x = _positive_number("cluster.host_op_x", file["host_op_x"])
        try:                                         # GPUSpec holds its range
            gpu_spec = replace(gpu_spec, host_op_x=x)
        except SpecError as err:
            raise SpecError("cluster.host_op_x", err.reason) from None

    gpus, gpus_field = _pick(num_gpus, "gpus", file, "gpus")
    if gpus is not None:
        gpus = _positive_int(gpus_field, gpus)
    site_fields, gpus_from_sites = _sites(file, gpus)
    if gpus is None:
        if gpus_from_sites is None:
            raise SpecError("gpus", "give the number of GPUs (--gpus, or 'gpus' in the cluster file)")
        gpus, gpus_field = gpus_from_sites, "cluster.sites.gpus_per_site"

    domain, domain_source = _domain_size(gpus_per_node, file, gpu_spec)
    per_site = gpus // site_fields["num_sites"]
    if per_site > domain and per_site % domain and domain > RACK_SCALE_DOMAIN:
        # rack-scale NVLink (NVL72): a job takes an equal share of each rack it uses, e.g. 256 GPUs
        # as 4 racks x 64; the job's NVLink domain is that share
        domain = max(d for d in range(1, domain + 1) if per_site % d == 0)
    if per_site > domain and per_site % domain:
        where, what = (("cluster.sites.gpus_per_site", f"{per_site} GPUs per site")
                       if site_fields["num_sites"] > 1 else (gpus_field, f"{gpus} GPUs"))
        raise SpecError(where, f"{what} is not a multiple of the NVLink domain size {domain} "
                        f"(from {domain_source}); use whole nodes")

    factor = file.get("fabric_bandwidth_factor", 1.0)
    if _positive_number("cluster.fabric_bandwidth_factor", factor) > 1:
        raise SpecError("cluster.fabric_bandwidth_factor", f"must be in (0, 1] (1 = non-blocking, "
                        f"0.5 = 2:1 oversubscribed), got {factor!r}")
    latencies = {spec_field: _positive_number(f"cluster.{key}", file[key]) * MICRO
                 for spec_field, key in (("intra_node_latency_s", "intra_node_latency_us"),
                                         ("inter_node_latency_s", "inter_node_latency_us"))
                 if file.get(key) is not None}
    name = file.get("name") or f"{gpus} x {gpu_spec.name}"

    return ClusterSpec(
        gpu=gpu_spec,
        num_gpus=gpus,
        nvlink_domain_size=min(domain, per_site),
        intra_node_bw_bytes_per_s=_bandwidth(intra_node_bw_gbps, "intra_node_bw_gbps", file,
                                             "intra_node_bandwidth_gb_per_s", gpu_spec.intra_node_bw_bytes_per_s),
        inter_node_bw_bytes_per_s=_bandwidth(inter_node_bw_gbps, "inter_node_bw_gbps", file,
                                             "inter_node_bandwidth_gb_per_s", gpu_spec.inter_node_bw_bytes_per_s),
        fabric_bw_factor=float(factor),
        name=str(name),
        **site_fields,
        **latencies,
    )
