"""Reading user files with one-line errors that name the field and the problem."""
from __future__ import annotations

import json

from costmodels.specs import SpecError


def read_json(path: str, field: str):
    """Parse a JSON file; a missing file or bad JSON is a SpecError naming `field`, the path and the line."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except OSError as exc:
        raise SpecError(field, f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SpecError(field, f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
