"""The compiled CPU forward (--compile-cpu-forward): the eager forward of a step on the CPU through `torch.compile`,
the attention layers (and the other eager points of the piecewise graphs) left eager between the compiled pieces.

On a card the decode and piecewise graphs remove the per-op launch cost; on the CPU a small model's step is mostly
that cost instead (issue 39: ~2.3 ms of eager ops per batch-1 step of a 2-layer model), and inductor fuses what
lies between two attention layers (residual adds, RMSNorm, rotary, SiLU-and-multiply) into a few C++ loops with
fewer tensors allocated. The eager points are the piecewise graphs' own (`eager_points`): their kernels read the
batch layout on the host or call numba, which dynamo would only break on, once per layer and shape. Shapes are
dynamic (one compile serves every token count; a batch of one is specialized once more). The first steps pay the
compile (about a minute on two busy cores for a 2-layer model; inductor's on-disk cache makes a later start of
the same model far shorter), so it is off unless asked: the flag, or `PAGEDESK_COMPILE_CPU_FORWARD=1` in the
environment, which is how the oracle parity tests are rerun with it on. One process only: tensor parallel's CPU
collectives stay eager, so it stays off there. A step whose eager forward runs every layer in one native call (a
decode step of a Llama-style float32 model: engine/layers/fused_decode.py) is left to it: on the 2-core Xeon the
compiled tiny model's batch-1 step took 3.67 ms, the one call's 1.51 (BENCHMARKS.md).
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from engine.worker.graphs.piecewise import eager_points

logger = logging.getLogger("pagedesk.engine")
ENV = "PAGEDESK_COMPILE_CPU_FORWARD"


def wanted(flag: bool) -> bool:
    """The flag, or the environment's request (the parity tests' way to run with it on)."""
    return flag or os.environ.get(ENV, "0") == "1"


class CompiledForward:
    """`model`'s forward compiled, its eager points excluded from every graph (dynamo calls them as they are). A
    compile that fails (no C++ compiler, an op inductor cannot lower) logs once and leaves the steps eager: a
    failed step wrote only KV slots its eager rerun rewrites with the same values."""

    def __init__(self, model: torch.nn.Module) -> None:
        # Dynamo compiles per function (the layers' forwards between two eager points) and gives up on one, running
        # it eager, after 8 variants; an earlier engine's variants in this process (a test session's) would count.
        torch._dynamo.reset()
        for module in eager_points(model):
            module.forward = torch.compiler.disable(module.forward, recursive=True)
        self.eager = model.forward
        # A step whose layers the eager forward runs as one native call (a decode step of a Llama-style float32
        # model: engine/layers/fused_decode.py) stays eager: the compiled graph runs them op by op, 2-3x slower.
        self.takes_one_call = getattr(getattr(model, "model", None), "takes_one_call", None)
        self.compiled: Callable | None = torch.compile(model.forward, dynamic=True)
        logger.info("compiling the CPU forward (torch.compile; the first steps wait for it)")

    def __call__(self, *args) -> torch.Tensor:
        if self.takes_one_call is not None and len(args) == 3 and self.takes_one_call(*args):
            return self.eager(*args)
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001 - any compile failure: the eager forward is always there
                logger.warning("the compiled CPU forward failed, steps run eager from now on: %s",
                               str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                self.compiled = None
        return self.eager(*args)
