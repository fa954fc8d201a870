"""What numba's CPU kernels (decode attention, small-batch linears) share: the thread pool their parallel builds
run on, and `renamed` for the serial build of a parallel kernel.

OpenMP first: a kernel launch wakes threads that wait passively (the engine's thread budget sets
OMP_WAIT_POLICY=PASSIVE, engine/platform/threads.py), which on the 2-core machine launched the linears' kernel
2-3x faster than numba's own `workqueue` pool (BENCHMARKS.md, "CPU linears"). Numba's OpenMP layer loads the
system's libgomp, a second runtime beside torch's, so without the passive wait two spinning pools would fight
over few cores; `workqueue` is the fallback where no libgomp loads (and `NUMBA_THREADING_LAYER` wins when set).
Import this before the first parallel launch. Imports nothing of ours.
"""
from __future__ import annotations

import os
import types

import numba

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "default"
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]


def renamed(fn, name: str):
    """The same code under another name: numba's on-disk cache files are named by the function, and the
    serial and parallel builds must not load each other."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = name
    return copy
