"""/metrics of the router: every running engine's Prometheus metrics in one exposition, each sample labelled
`engine="i"` (vLLM's data-parallel label: the replica's index within its model) next to its `model_name`.

Families with the same name from several engines are merged into one family (one HELP and TYPE line), so a
scraper sees `pagedesk:num_requests_running{engine="0",model_name="chat"}` and `{engine="1",...}` side by side.
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Merged:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_metrics(texts: list[tuple[str, str, str]]) -> bytes:
    """`texts`: (engine index, model name, exposition text) per engine; the merged exposition text."""
    merged: dict[str, Metric] = {}
    for engine, model_name, text in texts:
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {"model_name": model_name, **sample.labels, "engine": engine}
                out.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
