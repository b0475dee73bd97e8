"""Every schemathesis phase (examples, coverage, fuzzing, stateful) against a running service,
from its own OpenAPI document: what tests/test_fuzz.py asserts on with a fixed seed, and what
bench/fuzz.py runs for longer with random ones.

Nothing is judged inside schemathesis alone: every answer it got is looked at here too, so a
5xx or a leak is reported whichever check would have noticed it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from tests.support import TEST_SECRET
from tests.support.faults import LEAKS

if TYPE_CHECKING:
    from schemathesis.engine import events

# Jobs of tests/jobs.py the fuzzer may trigger: quick, and succeeding. The others fail or time
# out on purpose (500 or 504 is their documented answer), or hold a run up for seconds.
FAST_JOBS = frozenset({"fast", "minutely", "yearly", "late-minutely", "note", "keyed-fast"})

# Schemathesis' own list: what the coverage phase sends where the document has no such method.
UNEXPECTED_METHODS = frozenset(
    {"get", "put", "post", "delete", "options", "patch", "trace", "query"}
)

# The links of the document (cronlock/ops/views.py), as schemathesis names a transition: "<source>
# -> [<status>] <link> -> <target>".
LINKS = ("[202] GetRun", "[200] NextPage", "[200] NewestRun")


@dataclass
class Report:
    seed: int
    operations: list[str]
    requests: collections.Counter[str] = field(default_factory=collections.Counter)  # by phase
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    transitions: collections.Counter[str] = field(default_factory=collections.Counter)  # applied
    phases: dict[str, str] = field(default_factory=dict)  # phase -> "ran" or why it did not
    problems: list[str] = field(default_factory=list)

    def links_followed(self) -> set[str]:
        return {link for link in LINKS for t in self.transitions if f"{link} ->" in t}

    def summary(self) -> str:
        return (
            f"seed {self.seed}: {sum(self.requests.values())} requests {dict(self.requests)}, "
            f"statuses {dict(sorted(self.statuses.items()))}, phases {self.phases}, "
            f"transitions {dict(self.transitions)}, {len(self.problems)} problems"
        )


def document(base_url: str, headers: dict[str, str], jobs: Iterable[str]) -> dict[str, Any]:
    """The service's OpenAPI document with only `jobs`' triggers left (every other route but
    pause and resume)."""
    doc: dict[str, Any] = httpx.get(base_url + "/openapi.json", headers=headers, timeout=10).json()
    keep = set(jobs)
    # Pause and resume change what every trigger answers: the stateful phase follows
    # /cron/jobs' names to them and pauses the very jobs whose triggers are fuzzed ("paused"
    # from then on, no 202 to follow). tests/test_pause.py covers their bad input instead.
    for action in ("pause", "resume"):
        doc["paths"].pop(f"/cron/jobs/{{name}}/{action}", None)
    # A retry of a fan-out run's failed items: none of the fuzzed jobs fans out, so every call
    # is a 409, yet the stateful phase follows every run id to these two and spends its steps
    # there instead of on the document's links. tests/test_fanout_retry.py covers their input.
    doc["paths"].pop("/cron/runs/{run_id}/items/retry", None)
    doc["paths"].pop("/cron/runs/{run_id}/items/{n}/retry", None)
    for path, item in list(doc["paths"].items()):
        triggers = [op for op in item.values() if "jobs" in op.get("tags", ())]
        if triggers and path.removeprefix("/cron/") not in keep:
            del doc["paths"][path]
    return doc


def run(
    base_url: str,
    *,
    seed: int,
    max_examples: int,
    max_steps: int = 10,
    headers: dict[str, str] | None = None,
    jobs: Iterable[str] = FAST_JOBS,
    unexpected_methods: Iterable[str] = UNEXPECTED_METHODS,
) -> Report:
    """All phases against `base_url` (authenticated with `headers`), every answer judged;
    `unexpected_methods` are the methods the coverage phase expects a 405 (with Allow) for."""
    # Imported here, not at the top: schemathesis and hypothesis take seconds to import, and
    # every pytest worker imports this module while collecting (pyproject.toml: its plugins
    # are not loaded either).
    import schemathesis
    from schemathesis.engine import from_schema

    headers = headers if headers is not None else {"Authorization": f"Bearer {TEST_SECRET}"}
    doc = document(base_url, headers, jobs)
    config = schemathesis.Config.from_dict(
        {
            "seed": seed,
            "base-url": base_url,
            "headers": headers,
            "workers": 1,
            "request-timeout": 30,
            "continue-on-failure": True,
            # Each run stands alone: no examples replayed from earlier runs, no files left.
            "cache": {"enabled": False},
            "generation": {
                "mode": "all",
                "max-examples": max_examples,
                "allow-x00": True,
                "database": "none",
            },
            "phases": {
                "examples": {"enabled": True},
                "coverage": {"enabled": True, "unexpected-methods": sorted(unexpected_methods)},
                "fuzzing": {"enabled": True},
                "stateful": {"enabled": True, "max-steps": max_steps},
            },
            "checks": {
                # Rules the document cannot state: `force` with `slot`, a slot that is a past
                # tick of the schedule within the backfill window. Such 422s are right.
                "positive_data_acceptance": {"enabled": False},
                # Schemathesis' list plus 413: a body over MAX_BODY_BYTES is answered before
                # anything else about the request is looked at (413 before 422, the contract).
                "negative_data_rejection": {
                    "expected-statuses": [
                        *(400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429),
                        "5xx",  # reported below, with the answer
                    ]
                },
            },
        }
    )
    schema = schemathesis.openapi.from_dict(doc, config=config)
    # The secret the requests carry is a leak wherever it is (LEAKS names the tests' own).
    token = headers.get("Authorization", "").partition(" ")[2]
    leaks = (*LEAKS, token) if token else LEAKS
    report = Report(
        seed=seed,
        operations=sorted(f"{m.upper()} {p}" for p in doc["paths"] for m in doc["paths"][p]),
    )
    for event in from_schema(schema).execute():
        _record(report, event, leaks)
    return report


def _record(report: Report, event: events.EngineEvent, leaks: tuple[str, ...]) -> None:
    from schemathesis.engine import events

    if isinstance(event, events.PhaseStarted):
        phase = event.phase
        report.phases[phase.name.value] = (
            "ran" if phase.is_enabled else f"skipped: {phase.skip_reason}"
        )
    elif isinstance(event, events.ScenarioFinished):
        recorder = event.recorder
        for case_id, interaction in recorder.interactions.items():
            report.requests[event.phase.value] += 1
            response = interaction.response
            request = f"{interaction.request.method} {interaction.request.uri}"
            if response is None:
                report.problems.append(f"{event.phase.value}: no answer to {request}")
                continue
            report.statuses[response.status_code] += 1
            text = response.content.decode("utf-8", "replace")
            if response.status_code >= 500:
                report.problems.append(
                    f"{event.phase.value}: {response.status_code} for {request}: {text[:300]}"
                )
            for leak in leaks:
                if leak in text:
                    report.problems.append(f"{event.phase.value}: {request} leaks {leak!r}")
            node = recorder.cases.get(case_id)
            if node is not None and node.transition is not None and node.is_transition_applied:
                report.transitions[node.transition.id] += 1
        for case_id, checks in recorder.checks.items():
            for check in checks:
                if check.failure_info is None:
                    continue
                case = recorder.cases[case_id].value
                failure = check.failure_info.failure
                report.problems.append(
                    f"{event.phase.value}: check {check.name} failed for {case.method} "
                    f"{case.formatted_path} (query {case.query}): {failure.title}: "
                    f"{failure.message[:300]}"
                )
    elif isinstance(event, events.NonFatalError | events.FatalError):
        report.problems.append(f"schemathesis error: {event!r}"[:1000])
    elif isinstance(event, events.EngineFinished) and event.stop_reason != "completed":
        report.problems.append(f"stopped early: {event.stop_reason}")
