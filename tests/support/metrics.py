"""Reading an instance's /metrics as the tests do: the scrape token, and samples by name and
labels."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

METRICS_TOKEN = "metrics-token-0123456789-abcdefghijkl"
SCRAPE = {"Authorization": f"Bearer {METRICS_TOKEN}"}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(client: httpx.AsyncClient, url: str) -> Samples:
    r = await client.get(url + "/metrics", headers=SCRAPE)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    found: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))
