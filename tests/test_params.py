"""A trigger's params follow one rule over HTTP, the CLI and the dashboard (`parse_params`): a
field the job's model does not declare is a 422 naming it (a typo never runs the real job with
the defaults), a job without params takes no body, and every 422 has the documented shape."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from cronlock.core.jobs import define
from cronlock.core.params import parse_params
from cronlock.errors import InvalidTrigger
from cronlock.service import create_app
from cronlock.settings import Settings
from tests.test_inputs import in_process
from tests.util import runs


class Billing(BaseModel):
    dry_run: bool = False


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")
    dry_run: bool = False


class Ignoring(BaseModel):
    model_config = ConfigDict(extra="ignore")
    dry_run: bool = False


async def _noop(ctx: Any) -> None:
    return None


def problems(body: bytes, params: type[BaseModel] | None = Billing) -> list[dict[str, Any]]:
    job = define("p", params=params)(_noop)
    with pytest.raises(InvalidTrigger) as caught:
        parse_params(job, body)
    assert caught.value.detail == caught.value.args[0]
    return caught.value.detail


def test_an_unknown_field_is_refused_by_name() -> None:
    (problem,) = problems(b'{"dryrun": true}')
    assert problem["loc"] == ["dryrun"]
    assert problem["type"] == "extra_forbidden"
    # Declared fields still validate, and the job gets an instance of its own model.
    params = parse_params(define("p", params=Billing)(_noop), b'{"dry_run": true}')
    assert type(params) is Billing
    assert params.dry_run is True


def test_a_model_that_says_what_to_do_with_extras_is_obeyed() -> None:
    params = parse_params(define("p", params=Open)(_noop), b'{"dryrun": true}')
    assert type(params) is Open
    assert (params.dry_run, params.model_extra) == (False, {"dryrun": True})
    params = parse_params(define("p", params=Ignoring)(_noop), b'{"dryrun": true}')
    assert type(params) is Ignoring


def test_a_job_without_params_takes_no_body() -> None:
    job = define("p")(_noop)
    for body in (b"", b"  ", b"{}"):
        assert parse_params(job, body) is None
    assert [p["loc"] for p in problems(b'{"a": 1, "b": 2}', None)] == [["a"], ["b"]]
    for body in (b"null", b"[1]", b"3"):
        (problem,) = problems(body, None)
        assert (problem["loc"], problem["type"]) == ([], "extra_forbidden")
        assert "takes no params" in problem["msg"]


def test_every_problem_has_the_documented_shape() -> None:
    for body in (b"{not json", b"[" * 5000, b'{"dry_run": "perhaps"}', b'{"x": 1}'):
        for problem in problems(body):
            assert set(problem) >= {"loc", "msg", "type"}, problem
            assert isinstance(problem["loc"], list)
    (problem,) = problems(b"{not json")
    assert problem["type"] == "json_invalid"
    assert problem["msg"].startswith("Invalid JSON: ")
    # A text reason (a backfill slot's, a pause's) becomes the same shape, its loc given.
    assert InvalidTrigger("not a tick", ("slot",)).detail == [
        {"loc": ["slot"], "msg": "not a tick", "type": "value_error"}
    ]
    assert str(InvalidTrigger("not a tick", ("slot",))) == "slot: not a tick"


@pytest.fixture
async def api(make_settings: Callable[..., Settings]) -> AsyncIterator[httpx.AsyncClient]:
    async with in_process(create_app(make_settings())) as c:
        yield c


async def test_a_typo_or_a_stray_body_is_422_and_runs_nothing(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    r = await api.post("/cron/note", json={"txt": "hello"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["txt"]
    r = await api.post("/cron/fast", json={"dry_run": True})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["dry_run"]
    r = await api.post("/cron/fast", content=b"{not json")
    assert r.status_code == 422, r.text
    (problem,) = r.json()["detail"]
    assert (problem["loc"], problem["type"]) == ([], "json_invalid")
    # A backfill slot's refusal is a list too, naming the slot.
    r = await api.post("/cron/yearly", params={"slot": "2026-02-03T04:05:00Z"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["slot"]
    assert await runs(db, "note") == []
    assert await runs(db, "fast") == []
    assert (await api.post("/cron/fast", json={})).status_code == 200
