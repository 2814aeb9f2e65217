"""Reading user files safely: one-line `SpecError`s naming the field, bounded time and memory.

Every file a user names (model config, cluster file, calibration, runs file, training log) goes
through `read_text` and, for structured data, `parse_mapping_text` / `read_data`:

* only regular files are read (`/dev/zero`, a FIFO or a directory is refused before reading), and
  at most `MAX_FILE_BYTES` of them (a larger file is refused, not truncated);
* YAML is parsed without aliases (a 450-byte "billion laughs" file would expand to gigabytes) and
  without duplicate keys (YAML 1.2 forbids them; PyYAML silently keeps the last);
* JSON refuses duplicate keys too (RFC 8259 sec. 4: names SHOULD be unique; a duplicate is almost
  always a typo) and nesting deeper than `MAX_NESTING` (CPython's decoder recurses).
"""
from __future__ import annotations

import json
import os
import stat

import yaml

from .specs import SpecError

#: the largest user file read (64 MiB: a Megatron-LM log of ~10^5 iterations; configs are < 100 kB)
MAX_FILE_BYTES = 64 * 2 ** 20
#: deepest JSON / YAML nesting accepted (configs nest 3-4 levels)
MAX_NESTING = 64


def _one_line(text) -> str:
    return " ".join(str(text).split())


def read_text(path, field_name: str, *, max_bytes: int = MAX_FILE_BYTES, errors: str = "strict") -> str:
    """The UTF-8 text of a regular file of at most `max_bytes` bytes."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise SpecError(field_name, f"{path} is not a regular file")
            if st.st_size > max_bytes:
                raise SpecError(field_name, f"{path} is {st.st_size:,} bytes; the limit is {max_bytes:,}")
            data = fh.read(max_bytes + 1)
    except IsADirectoryError:
        raise SpecError(field_name, f"{path} is a directory, not a file") from None
    except OSError as exc:
        raise SpecError(field_name, f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:                      # grew while reading
        raise SpecError(field_name, f"{path} is larger than the limit of {max_bytes:,} bytes")
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise SpecError(field_name, f"{path} is not UTF-8 text (byte {exc.start})") from None


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------

class _DuplicateKey(Exception):
    def __init__(self, key):
        self.key = key


def _unique_pairs(pairs: list) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _json_depth(text: str) -> int:
    """Maximum bracket nesting, ignoring brackets inside strings (linear scan, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json(text: str, where: str, field_name: str):
    """JSON text -> Python; duplicate keys and deep nesting refused. NaN/Infinity tokens are kept
    (runs files may carry them; the readers skip or refuse such values with a note)."""
    if _json_depth(text) > MAX_NESTING:
        raise SpecError(field_name, f"{where} nests deeper than {MAX_NESTING} levels")
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except _DuplicateKey as exc:
        raise SpecError(field_name, f"{where} has the key {_one_line(exc.key)[:60]!r} twice") from None
    except json.JSONDecodeError as exc:
        raise SpecError(field_name, f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                        f"column {exc.colno}") from None
    except (RecursionError, ValueError) as exc:      # ValueError: a number too long to convert
        raise SpecError(field_name, f"{where} is not valid JSON: {_one_line(exc)[:80]}") from None


# ---------------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without aliases, duplicate keys or deep nesting."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, "aliases (*name) are not accepted", event.start_mark)
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_NESTING:
                raise yaml.constructor.ConstructorError(
                    None, None, f"nesting deeper than {MAX_NESTING} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:                     # an unhashable key: the base class reports it
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {_one_line(key)[:60]!r} is given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)


def _yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or exc
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{_one_line(problem)[:120]}{where}"


def parse_yaml(text: str, where: str, field_name: str):
    try:
        return yaml.load(text, Loader=_StrictLoader)       # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise SpecError(field_name, f"{where} is not valid YAML: {_yaml_error(exc)}") from None
    except RecursionError:
        raise SpecError(field_name, f"{where} nests too deeply") from None


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

def read_data(path, field_name: str, *, shipped: bool = False):
    """A JSON file (by suffix) or a YAML file, read and parsed under the limits above. `shipped`
    files (the package's own presets, checked by the tests) are parsed with libyaml when present:
    20x faster, which is most of the CLI's start-up."""
    text = read_text(path, field_name)
    if str(path).lower().endswith(".json"):
        return parse_json(text, str(path), field_name)
    if shipped and getattr(yaml, "__with_libyaml__", False):
        return yaml.load(text, Loader=yaml.CSafeLoader)        # noqa: S506 (the C SafeLoader)
    return parse_yaml(text, str(path), field_name)


def read_mapping(path, field_name: str, *, shipped: bool = False) -> dict:
    """`read_data` whose top level must be a mapping."""
    data = read_data(path, field_name, shipped=shipped)
    if not isinstance(data, dict):
        raise SpecError(field_name, f"{path} must hold a mapping of fields at the top level, "
                        f"got {type(data).__name__}")
    return data
