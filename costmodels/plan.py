"""The plan: one point of the parallelism space, and a batch of them as a struct of arrays.

Knob symbols: tp tensor, pp pipeline, dp data, cp context, ep expert, etp expert-tensor parallel,
vpp virtual pipeline stages per rank, mbs micro-batch size (sequences), recompute policy
(Megatron --recompute-granularity) and recompute_modules (--recompute-modules, with selective),
sp sequence parallelism, zero (0 plain DDP, 1 Megatron's distributed optimizer, 2 DeepSpeed ZeRO-2,
3 FSDP / ZeRO-3).

Pipeline split (Megatron-Core, core/transformer/transformer_block.py get_num_layers_to_build):
account_for_embedding / account_for_loss count the embedding / the loss as one layer each in the
even split (--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split);
first_layers / last_layers put that many layers on the first / last stage (0 = even split;
--decoder-first/last-pipeline-num-layers); `layout` is a --pipeline-model-parallel-layout string.
recompute_layers is the layers per virtual chunk that full recomputation replays (0 = all;
--recompute-method block --recompute-num-layers).

In a PlanBatch every field is an int32 array: recompute_modules a bit mask over RECOMPUTE_MODULES,
booleans 0/1, and `layout` an index into the batch's table of layout strings (0 = none); for a
layout plan the first_layers / last_layers arrays hold the layout's first and last rank's layers.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields

import numpy as np

from .specs import Recompute, SpecError

#: The plan fields in the order they are stored in a PlanBatch and shown in reports.
PLAN_FIELDS = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs", "recompute", "recompute_modules", "sp",
               "zero", "account_for_embedding", "account_for_loss", "first_layers", "last_layers",
               "recompute_layers", "layout")
#: fields whose default means "not used" (even pipeline split, recompute every layer, no layout, no
#: accounting); plan texts leave them out when unused
OPTIONAL_FIELDS = ("account_for_embedding", "account_for_loss", "first_layers", "last_layers",
                   "recompute_layers", "layout")

#: Megatron-Core --recompute-modules choices that this cost model knows (transformer_config.py);
#: the bit of module i in a mask is 1 << i
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe_act", "moe", "shared_experts", "mla_up_proj")
#: Megatron-Core's default set when --recompute-granularity selective is given without modules
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)


def modules_mask(names) -> int:
    mask = 0
    for n in names:
        if n not in RECOMPUTE_MODULES:
            raise SpecError("plan.recompute_modules", f"unknown module {n!r}; choose from "
                            f"{', '.join(RECOMPUTE_MODULES)}")
        mask |= 1 << RECOMPUTE_MODULES.index(n)
    return mask


def modules_of_mask(mask: int) -> tuple:
    return tuple(n for i, n in enumerate(RECOMPUTE_MODULES) if int(mask) >> i & 1)


def module_bit(name: str) -> int:
    return 1 << RECOMPUTE_MODULES.index(name)


@dataclass(frozen=True, kw_only=True)
class Plan:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    mbs: int = 1
    recompute: Recompute = Recompute.NONE
    recompute_modules: tuple = ()        # canonical order of RECOMPUTE_MODULES; only with selective
    sp: bool = False
    zero: int = 0
    account_for_embedding: bool = False
    account_for_loss: bool = False
    first_layers: int = 0
    last_layers: int = 0
    recompute_layers: int = 0
    layout: str = ""                     # --pipeline-model-parallel-layout ("" = none)

    def __post_init__(self):
        for f in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"plan.{f}", f"must be a positive integer, got {v!r}")
        for f in ("first_layers", "last_layers", "recompute_layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SpecError(f"plan.{f}", f"must be a non-negative integer (0 = not used), got {v!r}")
        for f in ("sp", "account_for_embedding", "account_for_loss"):
            if not isinstance(getattr(self, f), bool):
                raise SpecError(f"plan.{f}", f"must be true or false, got {getattr(self, f)!r}")
        if self.zero not in (0, 1, 2, 3):
            raise SpecError("plan.zero", f"must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.recompute, Recompute):
            raise SpecError("plan.recompute", f"must be a Recompute policy, got {self.recompute!r}")
        if tuple(self.recompute_modules) != modules_of_mask(modules_mask(self.recompute_modules)):
            raise SpecError("plan.recompute_modules", f"must be distinct names in the order "
                            f"{', '.join(RECOMPUTE_MODULES)}; got {self.recompute_modules!r}")
        if not isinstance(self.layout, str):
            raise SpecError("plan.layout", f"must be a layout string, got {self.layout!r}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @classmethod
    def from_row(cls, row: dict, layouts: tuple = ()) -> "Plan":
        """A plan from one row of integers (the PlanBatch encoding of every PLAN_FIELDS entry)."""
        v = {f: int(row.get(f, 0)) for f in PLAN_FIELDS}
        for f in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs"):
            v[f] = int(row.get(f, 1))
        v["recompute"] = Recompute(v["recompute"])
        for f in _BOOL_FIELDS:
            v[f] = bool(v[f])
        v["recompute_modules"] = modules_of_mask(v["recompute_modules"])
        if v["layout"]:
            v["layout"] = layouts[v["layout"] - 1]
            v["first_layers"] = v["last_layers"] = 0
        else:
            v["layout"] = ""
        return cls(**v)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """A plan from its report form (`as_dict`: recompute by name, modules as a list) or from a
        row of integers (a layout string may stand in the `layout` entry)."""
        v = dict(d)
        rec = v.get("recompute", 0)
        v["recompute"] = Recompute.parse(rec, "plan.recompute") if isinstance(rec, str) else Recompute(int(rec))
        mods = v.get("recompute_modules", ())
        if isinstance(mods, str):
            mods = [m for m in re.split(r"[+ ]", mods) if m]
        v["recompute_modules"] = (modules_of_mask(int(mods)) if isinstance(mods, (int, np.integer))
                                  else modules_of_mask(modules_mask(mods)))
        for f in _BOOL_FIELDS:
            if f in v:
                v[f] = bool(v[f])
        lay = v.get("layout", "")
        v["layout"] = lay if isinstance(lay, str) else ""
        known = {f.name for f in fields(cls)}
        return cls(**{k: val for k, val in v.items() if k in known})

    def row(self) -> dict:
        """The plan as one row of integers (layout index 1 when it has a layout)."""
        return {f: int(np.asarray(v)[0]) for f, v in PlanBatch.from_plans([self]).arrays.items()}

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)

    @property
    def modules_mask(self) -> int:
        return modules_mask(self.recompute_modules)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["recompute"] = self.recompute.name.lower()
        d["recompute_modules"] = list(self.recompute_modules)
        return d

    def __str__(self) -> str:
        return format_plan(self)


def _is_unused(key: str, value) -> bool:
    return key in OPTIONAL_FIELDS and not value


def format_plan(p: Plan) -> str:
    """The --plan text of a plan: unused optional fields left out, modules joined by '+', the
    layout last (its commas are cosmetic in Megatron and are dropped)."""
    d = p.as_dict()
    parts = []
    for k in PLAN_FIELDS:
        v = d[k]
        if _is_unused(k, v) or (k == "recompute_modules" and not v):
            continue
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif k == "recompute_modules":
            v = "+".join(v)
        elif k == "layout":
            v = v.replace(",", "")
        parts.append(f"{k}={v}")
    return ",".join(parts)


# ---------------------------------------------------------------------------------------------
# Megatron-Core pipeline layouts (core/transformer/pipeline_parallel_layer_layout.py)
# ---------------------------------------------------------------------------------------------

_LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
MAX_LAYOUT_CHARS = 100_000


def expand_layout(text: str) -> list[str]:
    """A layout string -> one string of layer characters per virtual stage, in Megatron's order
    (stage i = vpp rank i // pp, pp rank i % pp). Same unrolling as Megatron-Core's
    PipelineParallelLayerLayout.parse_str_to_list: cosmetic commas dropped, "(...)*n" then "x*n"."""
    s = str(text).replace(",", "").replace(" ", "")
    if not s:
        raise SpecError("plan.layout", "is empty")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        def unroll(m):
            n = int(m.group(2))
            if n * len(m.group(1)) + len(s) > MAX_LAYOUT_CHARS:
                raise SpecError("plan.layout", f"unrolls to more than {MAX_LAYOUT_CHARS} characters")
            return m.group(1) * n
        s = re.sub(pattern, unroll, s)
    bad = sorted(set(s) - set(_LAYOUT_CHARS) - {"|"})
    if bad:
        raise SpecError("plan.layout", f"unknown layer characters {''.join(bad)!r}; known: E (embedding), "
                        "t (transformer layer), m (MTP layer), L (loss), | (stage separator)")
    return s.split("|")


@dataclass(frozen=True)
class LayoutSplit:
    """What the cost model needs of a layout: transformer layers per pipeline rank (summed over its
    virtual stages; MTP layers counted as transformer layers), and the virtual-stage count."""
    layers_per_rank: tuple
    vpp: int

    @property
    def first(self) -> int:
        return self.layers_per_rank[0]

    @property
    def last(self) -> int:
        return self.layers_per_rank[-1]

    @property
    def middle_max(self) -> int:
        return max(self.layers_per_rank[1:-1], default=0)


def parse_layout(text: str, pp: int, num_layers: int, mtp_layers: int = 0) -> LayoutSplit:
    """Check a layout against Megatron-Core's rules (validate_layer_layout) for this pp and model (with
    `mtp_layers` MTP modules)."""
    stages = expand_layout(text)
    if len(stages) % pp:
        raise SpecError("plan.layout", f"has {len(stages)} stages, not a multiple of pp={pp}")
    flat = "".join(stages)
    if not flat.startswith("E") or flat.count("E") != 1:
        raise SpecError("plan.layout", "must start with the embedding 'E', exactly once")
    if not flat.endswith("L") or flat.count("L") != 1:
        raise SpecError("plan.layout", "must end with the loss 'L', exactly once")
    if flat.count("t") != num_layers:
        raise SpecError("plan.layout", f"holds {flat.count('t')} transformer layers 't', the model has "
                        f"{num_layers}")
    if flat.count("m") != mtp_layers:
        raise SpecError("plan.layout", f"holds {flat.count('m')} MTP layers 'm', the model has {mtp_layers} "
                        "(mtp_num_layers)")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        raise SpecError("plan.layout", "MTP layers 'm' must come after every transformer layer 't'")
    for chunks in (stages[i::pp] for i in range(pp)):    # each pp rank's virtual stages, in order
        if any("m" in c for c in chunks[:-1]):
            raise SpecError("plan.layout", "MTP layers 'm' must sit in the last virtual stage of their rank "
                            "(Megatron-Core validate_layer_layout)")
        if "m" in chunks[-1] and chunks[-1].count("m") != mtp_layers:
            raise SpecError("plan.layout", "all MTP layers 'm' must sit in one virtual stage")
    per_rank = [0] * pp
    for i, st in enumerate(stages):
        per_rank[i % pp] += st.count("t") + st.count("m")
    return LayoutSplit(tuple(per_rank), len(stages) // pp)


def balanced_layout(num_layers: int, pp: int, vpp: int, mtp_layers: int = 0) -> str:
    """The layout Megatron-Bridge builds for a model whose layers do not split evenly
    (recipes/deepseek: _get_deepseek_v3_pipeline_layout): ceil(L / stages) transformer layers per
    virtual stage, the embedding on the first, the remainder, MTP layers and the loss on the last.
    DeepSeek-V3 (61 layers) on pp=16: "Et*4|(t*4|)*14tmL"."""
    stages = pp * vpp
    if stages < 2:
        raise SpecError("plan.layout", "a layout needs at least two pipeline stages")
    per = -(-num_layers // stages)
    rem = num_layers - (stages - 1) * per
    if rem >= 0:
        mid = f"(t*{per}|)*{stages - 2}" if stages > 2 else ""
        return f"Et*{per}|{mid}{'t*' + str(rem) if rem else ''}{'m' * mtp_layers}L"
    # too few layers for that: count the embedding and the loss as a layer each (as Megatron's
    # account_for_* flags do) and give the first stages one unit more (DeepSeek-V3 on pp=8 vpp=4:
    # "Et|(tt|)*30mL")
    q, r = divmod(num_layers + 2, stages)
    if q < 1:
        raise SpecError("plan.layout", f"{num_layers} layers cannot fill {stages} pipeline stages")
    chunks = []
    for i in range(stages):
        units = q + (1 if i < r else 0) - (i == 0) - (i == stages - 1)
        chunks.append(("E" if i == 0 else "") + "t" * units + ("m" * mtp_layers + "L" if i == stages - 1 else ""))
    return "|".join(chunks)


def stage_layers(layers, pp, vpp, first_layers, last_layers, xp=np, *, acc_embedding=0, acc_loss=0,
                 layout=0):
    """Transformer layers on the first, a middle and the last pipeline stage (numpy or jax.numpy).

    Megatron-Core (get_num_layers_to_build): the first/last stage hold `first_layers`/`last_layers`
    when given (> 0) and the other stages share the rest evenly; else the embedding and the loss
    may count as one layer each (account_for_*), the units split evenly over pp, and the first /
    last rank build one transformer layer fewer. Legal plans divide exactly; otherwise a middle
    stage is charged ceil(rest / (stages * vpp)) * vpp layers. A layout plan (layout > 0) carries
    its first and last rank's layers in first/last_layers; its middle ranks are charged their mean
    (exact when they are equal, as in published layouts). pp = 1: one stage holds every layer.
    """
    has_layout = (layout > 0) * 1.0
    f_on = (first_layers > 0) * 1.0
    l_on = (last_layers > 0) * 1.0
    others = pp - f_on - l_on
    rest = layers - first_layers * f_on - last_layers * l_on
    n_mid_uneven = xp.where(has_layout > 0, xp.ceil(rest / xp.maximum(others, 1.0)),
                            xp.ceil(rest / xp.maximum(others * vpp, 1.0)) * vpp)
    n_mid_uneven = xp.where(others > 0, n_mid_uneven, 0.0)
    # even split with the embedding / loss counted as layers
    units = layers + acc_embedding + acc_loss
    per_rank = xp.ceil(units / xp.maximum(pp * vpp, 1.0)) * vpp
    uneven = (f_on + l_on) > 0
    n_mid = xp.where(uneven, n_mid_uneven, per_rank)
    n_first = xp.where(f_on > 0, first_layers * 1.0, xp.where(uneven, n_mid, per_rank - acc_embedding))
    n_last = xp.where(l_on > 0, last_layers * 1.0, xp.where(uneven, n_mid, per_rank - acc_loss))
    single = pp <= 1
    n_first = xp.where(single, layers * 1.0, n_first)
    n_last = xp.where(single, layers * 1.0, n_last)
    n_mid = xp.where(single, layers * 1.0, n_mid)
    return n_first, n_mid, n_last


#: how far past pp the search for an interleaving group size looks (the micro-batch count itself always works)
GROUP_SIZE_SEARCH = 64


def microbatch_group_size(micro_batches, pp, xp=np):
    """Megatron-Core's --microbatch-group-size-per-virtual-pipeline-stage N for an interleaved schedule of m
    micro-batches: its default pp when it divides m, else the smallest N in [pp, m] that the schedule takes
    (schedules.py forward_backward_pipelining_with_interleaving: m % N == 0 or m % N >= pp; N = m always does),
    looked for up to pp + GROUP_SIZE_SEARCH - 1, else m.
    The warm-up runs (vpp - 1) x N chunk forwards, so the smallest N holds the fewest activations. Numpy or
    jax.numpy, element-wise; m < pp has none (the schedule refuses it): returns m. m is rounded to whole
    micro-batches, so that the sensitivity's small continuous changes of the batch leave N as it is."""
    m, p = xp.round(xp.asarray(micro_batches)), xp.asarray(pp)
    n = p[..., None] + xp.arange(GROUP_SIZE_SEARCH)
    r = m[..., None] % n
    ok = (n <= m[..., None]) & ((r == 0) | (r >= p[..., None]))
    return xp.where(ok.any(axis=-1), p + xp.argmax(ok, axis=-1), m)


_BOOL = {"true": True, "1": True, "yes": True, "on": True,
         "false": False, "0": False, "no": False, "off": False}
_BOOL_FIELDS = ("sp", "account_for_embedding", "account_for_loss")
#: the longest integer a plan text may hold (more digits is not a GPU count, and int() of a
#: 5,000-digit string is slow)
_MAX_INT_DIGITS = 12


def parse_plan_text(text: str) -> dict:
    """Parse "tp=8,pp=16,recompute=full,sp=false" into typed knob values (absent keys omitted).

    recompute_modules are joined by '+' (core_attn+layernorm); a layout may contain Megatron's
    cosmetic commas (they are dropped): parts without '=' after `layout=` continue the layout."""
    out: dict = {}
    last_key = None
    for part in filter(None, (s.strip() for s in str(text).split(","))):
        if "=" not in part:
            if last_key == "layout":
                out["layout"] += part
                continue
            raise SpecError("plan", f"expected key=value, got {part!r}")
        key, value = (s.strip() for s in part.split("=", 1))
        key = key.lower()
        if key not in PLAN_FIELDS:
            raise SpecError("plan", f"unknown key {key!r}; known keys: {', '.join(PLAN_FIELDS)}")
        if key in out:
            raise SpecError(f"plan.{key}", "given twice")
        last_key = key
        if key == "recompute":
            out[key] = Recompute.parse(value, f"plan.{key}")
        elif key in _BOOL_FIELDS:
            if value.lower() not in _BOOL:
                raise SpecError(f"plan.{key}", f"expected true or false, got {value!r}")
            out[key] = _BOOL[value.lower()]
        elif key == "recompute_modules":
            names = tuple(n.strip().lower() for n in re.split(r"[+ ]", value) if n.strip())
            out[key] = modules_of_mask(modules_mask(names))
        elif key == "layout":
            out[key] = value
        else:
            v = value.strip()
            if not re.fullmatch(r"[+-]?\d{1,%d}" % _MAX_INT_DIGITS, v):
                raise SpecError(f"plan.{key}", f"expected an integer of at most {_MAX_INT_DIGITS} digits, "
                                f"got {value[:20]!r}")
            out[key] = int(v)
    if "layout" in out:
        expand_layout(out["layout"])          # syntax now; the rules check it against the model
    return out


def layout_rank_layers(text: str, pp: int) -> tuple:
    """Transformer (and MTP) layers per pipeline rank of a layout string, summed over virtual stages."""
    stages = expand_layout(text)
    per_rank = [0] * max(pp, 1)
    for i, st in enumerate(stages):
        per_rank[i % max(pp, 1)] += st.count("t") + st.count("m")
    return tuple(per_rank)


@dataclass(frozen=True)
class PlanBatch:
    """K plans as parallel numpy int32 arrays (one per field), the cost model's input. `layouts`
    holds the layout strings that the `layout` array indexes (1-based; 0 = none)."""
    arrays: dict
    layouts: tuple = ()

    def __post_init__(self):
        missing = [f for f in PLAN_FIELDS if f not in self.arrays]
        if missing:
            raise ValueError(f"PlanBatch is missing {missing}")

    def __len__(self) -> int:
        return int(np.asarray(self.arrays["tp"]).shape[0])

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    @classmethod
    def from_plans(cls, plans) -> "PlanBatch":
        plans = list(plans)
        layouts = tuple(dict.fromkeys(p.layout for p in plans if p.layout))
        rows = []
        for p in plans:
            row = {f: getattr(p, f) for f in PLAN_FIELDS}
            row["recompute_modules"] = p.modules_mask
            row["layout"] = layouts.index(p.layout) + 1 if p.layout else 0
            if p.layout:
                per_rank = layout_rank_layers(p.layout, p.pp)
                row["first_layers"], row["last_layers"] = per_rank[0], per_rank[-1]
            rows.append(row)
        arrays = {f: np.array([int(r[f]) for r in rows], dtype=np.int32) for f in PLAN_FIELDS}
        return cls(arrays, layouts)

    def select(self, index) -> "PlanBatch":
        return PlanBatch({k: np.asarray(v)[index] for k, v in self.arrays.items()}, self.layouts)

    def plan(self, i: int) -> Plan:
        return Plan.from_row({f: int(np.asarray(self.arrays[f])[i]) for f in PLAN_FIELDS}, self.layouts)
