"""What the dashboard's "Run now with params" form offers: the job's params model as a JSON
schema, and an example to start from, both from the pydantic model (so they cannot drift
from what a trigger accepts)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

# A nested model is followed this deep; past it an object is `{}` (a recursive model ends).
MAX_DEPTH = 4
# What a required field of a format starts as: a value of the right shape to edit.
FORMATS = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00",
    "email": "someone@example.com",
    "uri": "https://example.com/",
    "uuid": "00000000-0000-0000-0000-000000000000",
}


@dataclass(frozen=True)
class ParamsForm:
    schema: str  # the model's JSON schema, indented
    example: str  # a JSON object to start from, indented
    # Whether the example passes the model as it is (else a required field needs a real value).
    valid: bool


def form(model: type[BaseModel] | None) -> ParamsForm | None:
    """The form's schema and example for a job's params model; None for a job without one."""
    if model is None:
        return None
    schema = model.model_json_schema()
    found = _example(schema, schema.get("$defs", {}), 0)
    try:
        model.model_validate(found)
        valid = True
    except ValidationError:
        valid = False
    return ParamsForm(json.dumps(schema, indent=2), json.dumps(found, indent=2), valid)


def _example(prop: dict[str, Any], defs: dict[str, Any], depth: int) -> Any:
    """A value for one schema node: its own example or default, else one of its type."""
    if "$ref" in prop:
        target = defs.get(str(prop["$ref"]).rsplit("/", 1)[-1], {})
        return _example({**target, **{k: v for k, v in prop.items() if k != "$ref"}}, defs, depth)
    if prop.get("examples"):
        return prop["examples"][0]
    for key in ("default", "const"):
        if key in prop:
            return prop[key]
    if prop.get("enum"):
        return prop["enum"][0]
    for key in ("anyOf", "oneOf"):
        options = [o for o in prop.get(key, []) if o.get("type") != "null"]
        if options:
            return _example(options[0], defs, depth)
        if key in prop:
            return None
    kind = prop.get("type")
    if kind == "object":
        if depth >= MAX_DEPTH:
            return {}
        return {
            name: _example(sub, defs, depth + 1) for name, sub in prop.get("properties", {}).items()
        }
    if kind == "array":
        return []
    if kind == "boolean":
        return False
    if kind in ("integer", "number"):
        low = prop.get("minimum", prop.get("exclusiveMinimum"))
        value = 0 if low is None else low + (1 if "exclusiveMinimum" in prop else 0)
        return int(value) if kind == "integer" else value
    if kind == "string":
        return FORMATS.get(str(prop.get("format")), "x" * int(prop.get("minLength", 0)))
    return None
