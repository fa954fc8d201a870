"""`pagedesk-bench`: benchmarks that print tables for BENCHMARKS.md (throughput, memory, online serving,
reliability); never asserted in tests."""
from __future__ import annotations

import sys

COMMANDS = {"throughput": "engine.bench.throughput", "memory": "engine.bench.memory", "serve": "engine.bench.serve",
            "itl": "engine.bench.itl", "quant": "engine.bench.quant", "gguf": "engine.bench.gguf",
            "reliability": "engine.bench.reliability",
            "attacks": "engine.bench.attacks", "grammar": "engine.bench.grammar", "router": "engine.bench.router",
            "kv-groups": "engine.bench.kv_groups", "families": "engine.bench.families", "moe": "engine.bench.moe",
            "moe-tune": "engine.bench.moe_tune",
            "spec": "engine.bench.spec", "hybrid": "engine.bench.hybrid", "prepare": "engine.bench.prepare",
            "images": "engine.bench.images", "images-plan": "engine.bench.images_plan",
            "steps": "engine.bench.steps", "threads": "engine.bench.threads", "peer": "engine.bench.peer",
            "offload": "engine.bench.offload", "forward-ops": "engine.bench.forward_ops"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: pagedesk-bench {{{','.join(COMMANDS)}}} [options]  (--help after the command for options)")
        raise SystemExit(2)
    import importlib
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
