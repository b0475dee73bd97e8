"""A trigger's params, from the JSON body to the job's validated model: the one rule for HTTP,
the CLI's `run --params` and the dashboard's Run now."""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from cronlock.core.jobs import MAX_KEY_LENGTH, Job, key_text
from cronlock.errors import InvalidTrigger
from cronlock.inputs import json_problem, text_problem

__all__ = ["parse_params"]


def parse_params(job: Job, body: bytes) -> Any:
    """The job's validated params from the JSON body (InvalidTrigger for 422).

    The one rule for HTTP, the CLI's `--params` and the dashboard's Run now: a field the model
    does not declare is refused by name (a typo such as `dryrun` for `dry_run` must not run the
    real job with the default), unless the model itself says what to do with extras (`extra` in
    its `model_config`); a job without params takes no body but an empty one (or `{}`).
    """
    # No body is no params (the defaults); a body of `null` is not the object the document
    # asks for, and is refused like any other.
    data: Any = {}
    if body.strip():
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidTrigger(_not_json(str(exc))) from exc
        except RecursionError as exc:  # "[[[[...": within MAX_BODY_BYTES, deeper than Python
            raise InvalidTrigger(_not_json("nested too deeply")) from exc
    if job.params is None:
        if data != {}:
            raise InvalidTrigger(_no_params(job.name, data))
        return None
    try:
        _strict(job.params).model_validate(data)
        params = job.params.model_validate(data)
    except ValidationError as exc:
        raise InvalidTrigger(
            json.loads(exc.json(include_url=False, include_context=False, include_input=False))
        ) from exc
    # What the ledger stores (jsonb): refused here with the field's name, rather than by the
    # database with a data exception that names nothing.
    problem = json_problem(params.model_dump(mode="json"))
    if problem is not None:
        loc, msg = problem
        raise InvalidTrigger([{"type": "value_error", "loc": loc, "msg": f"Value {msg}"}])
    if job.key is not None:
        _check_key_value(job.key, getattr(params, job.key))
    return params


def _not_json(why: str) -> list[dict[str, Any]]:
    return [{"loc": [], "msg": f"Invalid JSON: {why}", "type": "json_invalid"}]


def _no_params(name: str, data: Any) -> list[dict[str, Any]]:
    """A body for a job that declares no params: each field named, or the body as a whole."""
    msg = f"Extra inputs are not permitted: job {name!r} takes no params"
    if isinstance(data, dict):
        return [{"loc": [key], "msg": msg, "type": "extra_forbidden"} for key in data]
    return [{"loc": [], "msg": msg, "type": "extra_forbidden"}]


@functools.cache
def _strict(model: type[BaseModel]) -> type[BaseModel]:
    """`model`, refusing fields it does not declare, unless its config says otherwise.

    Only validates (the job gets an instance of its own model); pydantic names each unknown
    field in an `extra_forbidden` error. A model that sets `extra` (`allow`, `ignore`) chose.
    """
    if "extra" in model.model_config:
        return model
    return type(model.__name__, (model,), {"model_config": ConfigDict(extra="forbid")})


def _check_key_value(field_name: str, value: Any) -> None:
    """A key the lock, the ledger and its index can all take, or a 422 naming the field."""
    try:
        text = key_text(value)
    except TypeError as exc:
        raise InvalidTrigger(
            [{"type": "key_error", "loc": [field_name], "msg": f"Value {exc}"}]
        ) from exc
    problem = text_problem(text)
    if problem is None and not text:
        problem = "is empty: a key needs at least one character"
    if problem is None and len(text) > MAX_KEY_LENGTH:
        problem = f"is longer than {MAX_KEY_LENGTH} characters as a key"
    if problem is not None:
        raise InvalidTrigger(
            [{"type": "key_error", "loc": [field_name], "msg": f"Value {problem}"}]
        )
