"""RequestFaults: per-request failures inside an engine step, so one bad request ends itself, not the engine.

The per-request parts of a step (planning its sampling rows, its grammar's bitmask, appending and
detokenising its tokens, building its output) run under `guard(request, stage)`: an exception there is
logged with the request id and recorded; the step skips that request's remaining work and goes on for the
others, and `LLMEngine` then aborts it (its blocks freed) and hands its caller an error output. Failures of
the batch as a whole (the forward pass, the device, a tensor-parallel worker) are not caught here: those end
the engine.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

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

    @contextlib.contextmanager
    def guard(self, request, stage: str) -> Iterator[None]:
        """Run a request's own work; an exception fails that request only."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - any fault of one request's work is that request's
            self.fail(request, stage, exc)

    def take(self) -> list[tuple[object, str]]:
        failed, self.failed = list(self.failed.values()), {}
        return failed
