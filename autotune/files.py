"""Reading user files with one-line errors that name the field and the problem."""
from __future__ import annotations

import json
import math
import os
import tempfile

from costmodels.files import parse_json, read_text
from costmodels.specs import SpecError


def read_json(path: str, field: str):
    """Parse a JSON file (a regular file, size-bounded, no duplicate keys, bounded nesting); any
    problem is a SpecError naming `field`, the path and the line."""
    return parse_json(read_text(path, field), str(path), field)


def same_file(a: str, b: str) -> bool:
    """True when two paths name one file (an existing one by inode, else by resolved path)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def refuse_overwriting_inputs(out: str, field: str, inputs: dict) -> None:
    """SpecError when `out` is one of the command's input files ({option: path})."""
    for option, path in inputs.items():
        if path and same_file(out, path):
            raise SpecError(field, f"{out} is the {option} input; writing there would destroy it. "
                            "Give another output path")


def write_text_atomic(path: str, text: str, field: str, *, exclusive: bool = False) -> str:
    """Write `text` to `path` through a temporary file in the same folder and `os.replace`, so a
    reader never sees a half-written file and a crash leaves the old file whole. With `exclusive`,
    an existing `path` is never replaced: `path` gets a -2, -3, ... suffix before its extension
    instead (concurrent searches into one folder keep every report). Returns the path written."""
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path)[-40:], dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            if exclusive:
                path = _link_unique(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise SpecError(field, f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def _link_unique(tmp: str, path: str) -> str:
    """Hard-link `tmp` to the first free name of path, path-2, path-3 ... (link fails if taken)."""
    stem, ext = os.path.splitext(path)
    for i in range(1, 10_000):
        candidate = path if i == 1 else f"{stem}-{i}{ext}"
        try:
            os.link(tmp, candidate)
            return candidate
        except FileExistsError:
            continue
    raise OSError(f"no free name for {path}")


def check_writable_folder(folder: str, field: str) -> None:
    """Fail fast (before a long search) when reports cannot be written into `folder`."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise SpecError(field, f"cannot write into {folder}: {exc.strerror or exc}") from None


def finite_or_null(obj):
    """A copy of a JSON-ready structure with NaN and +-Infinity replaced by None (JSON null):
    RFC 8259 has no non-finite numbers, and `json.dumps` would print `NaN` / `Infinity`."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "shape", None) == ():   # numpy scalars
        return finite_or_null(obj.item())
    return obj


def dumps_json(obj) -> str:
    """Strict JSON text (indent 2): non-finite numbers as null, `allow_nan=False` as the backstop;
    values JSON does not know (paths, enums) as their str()."""
    return json.dumps(finite_or_null(obj), indent=2, allow_nan=False, default=str)


def writable_dir(path: str) -> bool:
    """True when files can be created in `path` (made if missing): a probe file, not os.access,
    which is wrong for read-only mounts and some network file systems."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.unlink(tmp)
        return True
    except OSError:
        return False
