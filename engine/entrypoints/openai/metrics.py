"""Prometheus metrics with vLLM's names under the `pagedesk:` prefix, in a per-app CollectorRegistry.

Engine gauges and counters are read from the AsyncEngine's latest `EngineStats` at scrape time (a
custom collector, so totals come straight from the engine); request latencies are histograms the
routes observe as outputs arrive. A per-app registry lets several servers share one process.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.core.outputs import RequestOutput
from engine.entrypoints.openai.served_model import quantization_name

if TYPE_CHECKING:
    from engine.entrypoints.async_engine import AsyncEngine

PREFIX = "pagedesk:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineCollector(Collector):
    def __init__(self, async_engine: "AsyncEngine", model_name: str):
        self.async_engine, self.model_name = async_engine, model_name

    def collect(self) -> Iterator[Metric]:
        s = self.async_engine.stats
        gauges = (("num_requests_running", "Requests in the running batch", s.num_running),
                  ("num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
                  ("kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = all blocks in use)", s.kv_cache_usage),
                  ("engine_sleep_level", "Sleep mode: 0 awake, 1 weights in host RAM, 2 weights dropped",
                   s.sleep_level))
        counters = (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
                    ("num_preemptions", "Sequences preempted (freed, to recompute later)", s.num_preemptions),
                    ("prompt_tokens", "Prompt tokens computed", s.prompt_tokens_total),
                    ("generation_tokens", "Tokens generated", s.generation_tokens_total))
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(value))
            yield g
        engine = self.async_engine.engine  # set once loaded
        if engine is not None:
            info = GaugeMetricFamily(PREFIX + "model_info", "The served model; quantization: method, bits, group "
                                     "size of its weights, or none", labels=["model_name", "quantization"])
            info.add_metric([self.model_name, quantization_name(engine.model_config) or "none"], 1.0)
            yield info
        spec = s.spec_decode
        if spec is not None:  # speculative decoding: vLLM's counters
            counters += (("spec_decode_num_drafts", "Draft proposals verified", spec["num_drafts"]),
                         ("spec_decode_num_draft_tokens", "Draft tokens proposed", spec["num_draft_tokens"]),
                         ("spec_decode_num_accepted_tokens", "Draft tokens accepted", spec["num_accepted_tokens"]))
        for name, doc, value in counters:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(value))
            yield c
        if spec is not None:
            c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each position of a proposal",
                                    labels=["model_name", "position"])
            for position, value in enumerate(spec["accepted_per_pos"]):
                c.add_metric([self.model_name, str(position)], float(value))
            yield c
        yield from _tier_metrics(s.kv_offload, self.model_name)
        load = s.expert_load
        if load is not None:  # MoE models: one series per (decoder layer, expert)
            c = CounterMetricFamily(PREFIX + "moe_expert_tokens", "Tokens routed to each expert of each MoE layer "
                                    "(each of a token's top-k choices counts once)",
                                    labels=["model_name", "layer", "expert"])
            for layer, row in zip(load["layers"], load["tokens"]):
                for expert, value in enumerate(row):
                    c.add_metric([self.model_name, str(layer), str(expert)], float(value))
            yield c


def _tier_metrics(tier: dict | None, model_name: str) -> Iterator[Metric]:
    """The prefix cache's CPU-RAM tier (--kv-offloading-size): nothing without one. Bytes are rank 0's shard."""
    if tier is None:
        return
    gauges = (("kv_offload_blocks", "Blocks the CPU-RAM tier holds", tier["blocks_held"]),
              ("kv_offload_usage_perc", "CPU-RAM tier usage, 0..1", tier["blocks_held"] / max(1, tier["num_blocks"])),
              ("kv_offload_capacity_bytes", "Host bytes of the CPU-RAM tier (one rank)", tier["capacity_bytes"]),
              ("kv_offload_loads_in_flight", "Sequences waiting for copies from the CPU-RAM tier",
               tier["loads_in_flight"]))
    counters = (("kv_offload_hit_tokens", "Prompt tokens the GPU prefix cache missed and the CPU-RAM tier restored",
                 tier["hit_tokens"]),
                ("kv_offload_miss_tokens", "Prompt tokens neither the GPU prefix cache nor the CPU-RAM tier held",
                 tier["miss_tokens"]),
                ("kv_offload_stored_bytes", "Bytes copied from the GPU to the CPU-RAM tier", tier["bytes_stored"]),
                ("kv_offload_loaded_bytes", "Bytes copied from the CPU-RAM tier back to the GPU", tier["bytes_loaded"]))
    for name, doc, value in gauges:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        g.add_metric([model_name], float(value))
        yield g
    for name, doc, value in counters:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric([model_name], float(value))
        yield c


class ServerMetrics:
    def __init__(self, async_engine: "AsyncEngine", model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(async_engine, model_name))

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between generated tokens", LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish, per request", E2E_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """Observes one request's first-token, inter-token and end-to-end latencies as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = self.last = time.perf_counter()
        self.num_tokens = 0

    def on_output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        num_tokens = sum(len(o.token_ids) for o in out.outputs)
        new = num_tokens - self.num_tokens
        if new > 0:
            if self.num_tokens == 0:
                self.metrics.ttft.observe(now - self.arrival)
                new -= 1
            for _ in range(new):
                self.metrics.itl.observe((now - self.last) / max(new, 1))
            self.num_tokens, self.last = num_tokens, now
        if out.finished:
            self.metrics.e2e.observe(now - self.arrival)
