"""RequestFaults: per-request failures inside an engine step, so one bad request ends itself, not the engine.

The per-request parts of a step (planning its sampling rows, its grammar's bitmask, appending and
detokenising its tokens, building its output) run under `guard(request, stage)`: an exception there is
logged with the request id and recorded; the step skips that request's remaining work and goes on for the
others, and `LLMEngine` then aborts it (its blocks freed) and hands its caller an error output. Failures of
the batch as a whole (the forward pass, the device, a tensor-parallel worker) are not caught here: those end
the engine.
"""
from __future__ import annotations

import logging

log = logging.getLogger("pagedesk.engine")


class RequestFaults:
    def __init__(self) -> None:
        self.failed: dict[str, tuple[object, str]] = {}  # request id -> (Request, what went wrong)

    def __contains__(self, request) -> bool:
        return request.request_id in self.failed

    def fail(self, request, stage: str, exc: BaseException) -> None:
        if request.request_id in self.failed:
            return
        log.error("request %s failed while %s; it ends, the other requests go on", request.request_id, stage,
                  exc_info=exc)
        self.failed[request.request_id] = (request, f"the engine failed this request while {stage}: "
                                                    f"{type(exc).__name__}: {str(exc)[:300]}")

    def guard(self, request, stage: str) -> "_Guard":
        """Run a request's own work (`with faults.guard(request, stage):`); an exception fails that request only."""
        return _Guard(self, request, stage)

    def take(self) -> list[tuple[object, str]]:
        failed, self.failed = list(self.failed.values()), {}
        return failed


class _Guard:
    """A plain context manager, not a generator's: it is entered for every token of every step."""

    __slots__ = ("faults", "request", "stage")

    def __init__(self, faults: RequestFaults, request, stage: str) -> None:
        self.faults, self.request, self.stage = faults, request, stage

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if kind is None or not issubclass(kind, Exception):  # BaseException (KeyboardInterrupt) ends the step
            return False
        self.faults.fail(self.request, self.stage, exc)  # any fault of one request's work is that request's
        return True
