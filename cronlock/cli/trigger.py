"""`trigger`: POST a job to a running service, as a scheduler would, and map its answer to an
exit code; `--follow` polls an accepted run until it ends."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import httpx

from cronlock import inputs
from cronlock.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    OPTION,
    PARAMS,
    fail,
    job_name,
    service_url,
)
from cronlock.settings import MIN_SECRET_LENGTH, Settings

DEFAULT_SERVICE_URL = "http://127.0.0.1:8000"


def add_commands(sub: Any) -> None:
    trigger = sub.add_parser(
        "trigger",
        help="POST a job to a running service (secret from CRON_SECRET or CRON_SECRET_FILE)",
    )
    trigger.add_argument("job", type=job_name)
    trigger.add_argument(
        "--url",
        type=service_url,
        default=os.environ.get("CRONLOCK_URL", DEFAULT_SERVICE_URL),
        help=f"the service (default: $CRONLOCK_URL or {DEFAULT_SERVICE_URL})",
    )
    trigger.add_argument("--force", action="store_true", help="run even if the slot is done")
    # Checked by the service (a 422 is exit 2, with its answer), as for any other client.
    trigger.add_argument(
        "--slot", type=OPTION, help="backfill this past tick (ISO time with offset)"
    )
    trigger.add_argument("--params", type=PARAMS, help="the job's params as JSON")
    trigger.add_argument(
        "--no-wait", action="store_true", help="answer once the lock is taken (202 + run id)"
    )
    trigger.add_argument(
        "--follow", action="store_true", help="with --no-wait: poll the run until it ends"
    )
    trigger.add_argument(
        "--timeout",
        type=trigger_timeout,
        default=3600.0,
        help="HTTP timeout, seconds (--follow: also how long it retries a lost service)",
    )
    trigger.add_argument("--json", action="store_true", help="print the answer as JSON")
    trigger.set_defaults(handler=cmd_trigger)


# HTTP answers of `POST /cron/<job>` -> exit code; any other 5xx is 3 (the service or what is
# in front of it cannot serve), any other answer 2 (a 4xx: the request, the secret).
TRIGGER_EXIT = {
    200: EXIT_OK,
    202: EXIT_OK,
    500: EXIT_FAILED,
    503: EXIT_UNAVAILABLE,
    504: EXIT_FAILED,
}
# A trigger waits for its job: an hour by default, some days at most (httpx cannot take more
# than a few hundred years, and nobody means that).
TRIGGER_TIMEOUT_MAX = 1_000_000
# What `--follow` retries: the service restarting or a proxy without a backend for a moment.
TRANSIENT_STATUS = (502, 503, 504)


def trigger_timeout(text: str) -> float:
    value = inputs.positive_seconds(text)
    if value > TRIGGER_TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {TRIGGER_TIMEOUT_MAX} seconds")
    return value


def trigger_exit(status: int) -> int:
    if status in TRIGGER_EXIT:
        return TRIGGER_EXIT[status]
    return EXIT_UNAVAILABLE if status >= 500 else EXIT_USAGE


class UnexpectedAnswer(Exception):
    """An answer that is not the service's (a proxy's HTML page, a body of the wrong shape)."""


def cmd_trigger(args: argparse.Namespace, settings: Settings) -> int:
    tokens = settings.secrets()
    if not tokens:
        return fail("set CRON_SECRET or CRON_SECRET_FILE (never on the command line)", EXIT_USAGE)
    if len(tokens[0]) < MIN_SECRET_LENGTH:  # an empty file, say: no service accepts it
        where = (
            "CRON_SECRET"
            if settings.cron_secret
            else f"CRON_SECRET_FILE {settings.cron_secret_file}"
        )
        return fail(f"{where} is shorter than {MIN_SECRET_LENGTH} characters", EXIT_USAGE)
    headers = {"Authorization": f"Bearer {tokens[0].decode()}"}
    params: dict[str, str] = {}
    if args.force:
        params["force"] = "true"
    if args.slot:
        params["slot"] = args.slot
    if args.no_wait:
        params["wait"] = "false"
    content = args.params.encode() if args.params else None
    if content is not None:
        headers["Content-Type"] = "application/json"
    base = args.url.rstrip("/")
    try:
        with httpx.Client(timeout=args.timeout) as client:
            answer = client.post(
                f"{base}/cron/{args.job}", params=params, content=content, headers=headers
            )
            body = _json_or_text(answer)
            status = answer.status_code
            code = trigger_exit(status)
            if status == 202 and args.follow:
                run_id = body.get("run_id") if isinstance(body, dict) else None
                if not isinstance(run_id, int) or isinstance(run_id, bool):
                    raise UnexpectedAnswer("a 202 without a run id")
                polled, run = _follow(client, base, headers, run_id, args.timeout)
                body = {"accepted": body, "run": run}
                if polled != 200:
                    code = EXIT_UNAVAILABLE if polled >= 500 else EXIT_USAGE
                else:
                    code = EXIT_OK if run.get("status") == "succeeded" else EXIT_FAILED
    except httpx.HTTPError as exc:
        return fail(f"service unreachable at {base}: {exc}", EXIT_UNAVAILABLE)
    except UnexpectedAnswer as exc:
        return fail(f"not the service's answer from {base}: {exc}", EXIT_UNAVAILABLE)
    if args.json:
        print(json.dumps(body))
    elif status == 404 and isinstance(body, dict) and body.get("error") == "unknown job":
        # The rule of every command naming a job (cli/common.py `known_job`): one line, exit 2.
        return fail(f"unknown job {args.job!r} at {base}", EXIT_USAGE)
    elif isinstance(body, dict):
        prefix = f"HTTP {status}"
        print(prefix + " " + " ".join(f"{k}={v}" for k, v in body.items()))
    else:
        print(f"HTTP {status} {body}")
    return code


def _json_or_text(answer: Any) -> Any:
    try:
        return answer.json()
    except ValueError:
        return answer.text


def _follow(
    client: Any, base: str, headers: dict[str, str], run_id: int, bound: float
) -> tuple[int, dict[str, Any]]:
    """Poll `GET /cron/runs/{id}` until the run has ended: its last answer's status and body.
    A lost connection or a 502/503/504 is retried until `bound` seconds without a good answer
    (the service restarting must not end a run's follower while the run goes on)."""
    good = time.monotonic()
    while True:
        try:
            answer = client.get(f"{base}/cron/runs/{run_id}", headers=headers)
        except httpx.TransportError:
            if time.monotonic() - good >= bound:
                raise
            time.sleep(0.5)
            continue
        if answer.status_code in TRANSIENT_STATUS and time.monotonic() - good < bound:
            time.sleep(0.5)
            continue
        run = _json_or_text(answer)
        if not isinstance(run, dict):
            raise UnexpectedAnswer(f"HTTP {answer.status_code}, not a JSON object")
        if answer.status_code != 200 or run.get("status") != "running":
            return answer.status_code, run
        good = time.monotonic()
        time.sleep(0.5)
