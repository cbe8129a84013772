"""Prometheus /metrics scrapes, parsed with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One scrape: sample value by name and labels (a subset of the sample's labels matches)."""

    def __init__(self, text: str) -> None:
        self.samples = [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
                        for s in family.samples]

    def get(self, name: str, **labels: str) -> float:
        """The sum over the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        return sum(v for n, ls, v in self.samples if n == name and labels.items() <= ls.items())

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [ls for n, ls, _v in self.samples if n == name]


async def scrape(port: int) -> Scrape:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200
            return reply.read().decode()
    return Scrape(await asyncio.to_thread(get))
