"""Hostile input through nginx and PgBouncer: every route fuzzed from the OpenAPI document,
broken credentials, oversized and malformed bodies, job names that try SQL or path tricks.
Never a 5xx, never an answer that leaks internals, nothing executed that should not be.
(The same cases straight at an instance are in tests/test_api.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import asyncpg
import httpx
import pytest

from tests.support import TEST_SECRET, fuzz
from tests.support.cluster import Cluster, Instance
from tests.support.faults import LEAKS, reset, settle
from tests.util import AUTH, effects, runs

pytestmark = pytest.mark.cluster

PREVIOUS = "p" * 40
MAX_BODY = 1024
SEED = 7
EXAMPLES = 50


@pytest.fixture
def database_url(module_database_url: str) -> str:
    """The module's database: its cluster runs on it, `db` looks at it straight."""
    return module_database_url


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., Cluster], module_database_url: str) -> Cluster:
    """Two instances behind nginx and PgBouncer, in the middle of a secret rotation."""
    env = {
        "CRON_JOBS": "tests.jobs",
        "CRON_SECRET_PREVIOUS": PREVIOUS,
        "MAX_BODY_BYTES": str(MAX_BODY),
    }
    return make_cluster(module_database_url, instances=2, pool_per_instance=4, env=env)


@pytest.fixture
def url(cluster: Cluster, report_logs: Callable[[list[Instance]], None]) -> Iterator[str]:
    """nginx's URL; a PgBouncer that died meanwhile fails the test with its log."""
    assert cluster.nginx is not None
    assert cluster.pgbouncer is not None
    report_logs(cluster.instances)
    cluster.pgbouncer.check_alive()
    yield cluster.nginx.url
    cluster.pgbouncer.check_alive()


@pytest.fixture(autouse=True)
async def _fresh(db: asyncpg.Connection) -> None:
    await reset(db)


def assert_no_leak(answer: httpx.Response | Any) -> None:
    for leak in LEAKS:
        assert leak not in answer.text, answer.text


# --- fuzzing ------------------------------------------------------------------------------


def test_every_route_fuzzed_from_the_openapi_document(url: str, cluster: Cluster) -> None:
    """Every schemathesis phase on every operation the OpenAPI document lists (with the
    secret), through nginx and PgBouncer: no 5xx, nothing internal in any answer, the links
    followed (tests/test_fuzz.py does the same at one instance)."""
    # nginx answers TRACE itself (405, without Allow) before an instance could: not ours.
    methods = fuzz.UNEXPECTED_METHODS - {"trace"}
    report = fuzz.run(url, seed=SEED, max_examples=EXAMPLES, unexpected_methods=methods)
    assert report.problems == [], "\n".join([report.summary(), *report.problems[:30]])
    assert set(report.phases.values()) == {"ran"}, report.summary()
    routes = {op.split(" ", 1)[1] for op in report.operations}
    assert {"/cron/jobs", "/cron/runs", "/cron/runs/{run_id}", "/cron/locks"} <= routes
    # The jobs that fail, time out or sleep on purpose are left out, the quick ones are in.
    assert {f"/cron/{job}" for job in fuzz.FAST_JOBS} <= routes
    assert not {"/cron/slow", "/cron/fails", "/cron/times-out"} & routes
    # Transitions ran; which links the stateful phase reaches through the cluster depends on
    # what the runs table holds by then (NextPage needs a full page): tests/test_fuzz.py, on a
    # quiet instance, asserts every link.
    assert report.links_followed(), report.summary()
    assert report.links_followed() <= set(fuzz.LINKS), report.summary()
    for instance in cluster.instances:
        instance.check_alive()


# --- credentials --------------------------------------------------------------------------

BAD_AUTH: list[dict[str, str] | dict[bytes, bytes]] = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": f"Bearer  {TEST_SECRET}"},
    {"Authorization": f"Bearer\t{TEST_SECRET}"},
    {"Authorization": f"Bearer {TEST_SECRET} {TEST_SECRET}"},
    {"Authorization": f"Basic {TEST_SECRET}"},
    {"Authorization": f"Token {TEST_SECRET}"},
    {"Authorization": TEST_SECRET},
    {"Authorization": f"Bearer {TEST_SECRET}x"},
    {"Authorization": f"Bearer {TEST_SECRET[:-1]}"},
    {"Authorization": f"Bearer {TEST_SECRET.upper()}"},
    {"Authorization": "Bearer " + "a" * 10_240},
    {b"Authorization": b"Bearer " + "é".encode() * 40},
    {b"Authorization": b"Bearer " + TEST_SECRET.encode()[:-1] + b"\xff"},
]


async def test_bad_credentials_are_401_through_nginx(
    url: str, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    for headers in BAD_AUTH:
        for method, path in (
            ("POST", "/cron/fast"),
            ("POST", "/cron/no-such-job"),
            ("GET", "/cron/jobs"),
            ("GET", "/openapi.json"),
        ):
            r = await client.request(method, url + path, headers=headers)
            assert r.status_code == 401, (headers, path, r.status_code, r.text[:200])
            assert r.json() == {"error": "Unauthorized"}
            assert r.headers["www-authenticate"] == "Bearer"
    assert await runs(db, "fast") == []


async def test_token_in_the_query_string_is_never_read(
    url: str, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    for name in ("token", "access_token", "secret", "authorization", "Authorization"):
        for value in (TEST_SECRET, f"Bearer {TEST_SECRET}"):
            r = await client.post(url + "/cron/fast", params={name: value})
            assert r.status_code == 401, (name, value)
    assert await runs(db, "fast") == []


async def test_scheme_is_case_insensitive_and_the_previous_secret_works_during_rotation(
    url: str, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    accepted = [f"bearer {TEST_SECRET}", f"BEARER {TEST_SECRET}", f"Bearer {PREVIOUS}"]
    for header in accepted:
        r = await client.post(url + "/cron/fast", headers={"Authorization": header})
        assert r.status_code == 200, (header, r.text)
    assert await effects(db, "fast") == len(accepted)


async def test_the_old_secret_is_refused_once_rotation_ends(
    start_instance: Callable[..., Instance],
    start_nginx: Callable[..., Any],
    client: httpx.AsyncClient,
    database_url: str,
) -> None:
    """CRON_SECRET_PREVIOUS removed (the instance redeployed): the old secret is a 401."""
    rotated = start_instance("rotated", {"CRON_SECRET": PREVIOUS + "-new-one"})
    proxy = start_nginx([rotated.address])
    for secret in (PREVIOUS, TEST_SECRET):
        r = await client.post(
            proxy.url + "/cron/fast", headers={"Authorization": f"Bearer {secret}"}
        )
        assert r.status_code == 401, secret
    r = await client.post(
        proxy.url + "/cron/fast", headers={"Authorization": f"Bearer {PREVIOUS}-new-one"}
    )
    assert r.status_code == 200, r.text


# --- bodies and names ---------------------------------------------------------------------


async def test_oversized_bodies_are_413(
    url: str, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    # Over MAX_BODY_BYTES: the instance's 413, declared or streamed (chunked, no length).
    r = await client.post(url + "/cron/fast", content=b"{" * (MAX_BODY + 1), headers=AUTH)
    assert (r.status_code, r.json()["error"]) == (413, "request body too large")

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b" " * 512

    r = await client.post(url + "/cron/fast", content=chunks(), headers=AUTH)
    assert r.status_code == 413, r.text
    # Over nginx's client_max_body_size: nginx's own 413, before any instance sees it.
    r = await client.post(url + "/cron/fast", content=b"x" * (2 * 1024 * 1024), headers=AUTH)
    assert r.status_code == 413
    # Credentials still come first for what nginx lets through.
    r = await client.post(url + "/cron/fast", content=b"{" * (MAX_BODY + 1))
    assert r.status_code == 401
    assert await runs(db, "fast") == []


async def test_invalid_json_is_422(
    url: str, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    bodies = [b"{not json", b"[1, 2", b"\xff\xfe\x00", b'{"seconds": 1', b"nan", b"'single'"]
    for job in ("fast", "slow"):
        for body in bodies:
            r = await client.post(
                url + f"/cron/{job}",
                content=body,
                headers={**AUTH, "Content-Type": "application/json"},
            )
            assert r.status_code == 422, (job, body, r.text)
            assert_no_leak(r)
    for params in ('"a string"', "[]", '{"seconds": "long"}', '{"seconds": -1}', "1e999"):
        r = await client.post(url + "/cron/slow", content=params.encode(), headers=AUTH)
        assert r.status_code == 422, (params, r.text)
    assert await runs(db, "fast") == []
    assert await runs(db, "slow") == []


TRICKY_NAMES = [
    "fast;DROP TABLE cronlock.runs",
    "fast'--",
    "fast' OR '1'='1",
    'fast"; SELECT pg_sleep(10); --',
    "fast%00",
    "fast%0ASELECT",
    "%2e%2e%2fopenapi.json",
    "..%2f..%2fetc%2fpasswd",
    "fast%2f..%2fslow",
    "fast/",
    "fast/extra",
    "FAST",
    "fast%20",
    "jobs%3Bselect",
    "$(id)",
    "%C3%A9t%C3%A9",
    "a" * 300,
]


async def test_tricky_job_names_are_404_and_run_nothing(
    url: str, client: httpx.AsyncClient, db: asyncpg.Connection, cluster: Cluster
) -> None:
    for name in TRICKY_NAMES:
        r = await client.post(url + "/cron/" + name, headers=AUTH)
        assert r.status_code in (400, 404), (name, r.status_code, r.text)
        if r.status_code == 404:
            # A name the route pattern cannot match at all (a newline) gets the plain 404.
            assert r.json()["error"] in ("unknown job", "Not Found"), (name, r.text)
        assert_no_leak(r)
    assert await db.fetchval("SELECT count(*) FROM cronlock.runs") == 0
    assert await effects(db) == 0
    await settle(db, cluster)
