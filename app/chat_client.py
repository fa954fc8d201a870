"""Streams one chat completion from the local OpenAI-compatible endpoint in a worker thread.

`ChatWorker.run` first fits the request into the model's context (app/context_fit.py: the prompt counted
by the server's /tokenize, Max tokens lowered or the oldest turns dropped, announced by `fitted`), then POSTs /v1/chat/completions with stream=true via httpx, emits each content delta,
and finishes with a `ChatResult`: time to first token, generated tokens (from `usage` when the
server sends it, else one per content chunk) and decode tokens/s (first to last token, omitted for replies
shorter than MIN_RATE_TOKENS, whose few chunks can arrive at once). A chat carrying images is sent without
the fit: /tokenize cannot count an image's tokens (the engine's image processor makes them), so the meter takes
the reply's `usage`, whose prompt count includes every image token, against the context /v1/models gave. `context_used` reports the prompt's
count and the model's context after the fit, and the chat's total after the reply, for the context meter. `stop()` closes the stream at the
next chunk, which makes the server abort the request. Failures come out as sentences a user can
act on — the server's own error message (HTTP error or in-band stream error), "the engine stopped
while answering" for a cut connection — never a Python exception name. `ChatClient` owns the
thread for the panel.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
from PySide6.QtCore import QObject, Qt, QThread, Signal

from app.context_fit import ContextFull, Fit, fit_to_context
from app.units import format_ms
from app.sse import auth_headers, iter_sse_data


@dataclass
class ChatRequest:
    base_url: str
    model: str
    messages: list[dict]
    api_key: str | None = None
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512
    fit_context: bool = True  # count through /tokenize first and fit (app/context_fit.py)
    max_model_len: int = 0  # the model's context from /v1/models, for the meter when the fit is skipped (0: unknown)

    def has_images(self) -> bool:
        return any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
                   for m in self.messages)

    def body(self) -> dict:
        return {"model": self.model, "messages": self.messages, "stream": True, "temperature": self.temperature,
                "top_p": self.top_p, "max_tokens": self.max_tokens, "stream_options": {"include_usage": True}}


MIN_RATE_TOKENS = 8  # a shorter reply's rate is noise (its chunks may arrive within a millisecond)


@dataclass
class ChatResult:
    text: str = ""
    reasoning: str = ""  # reasoning_content deltas (a server started with --reasoning-parser)
    ttft_s: float | None = None
    last_token_s: float | None = None  # since the request was sent, like ttft_s
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    max_model_len: int = 0  # from the context fit (0: not counted)
    model: str = ""  # the model that wrote it, as the server's chunks name it

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate from the first token to the last; None below MIN_RATE_TOKENS or without a span."""
        if self.completion_tokens < MIN_RATE_TOKENS or self.ttft_s is None or self.last_token_s is None:
            return None
        decode_s = self.last_token_s - self.ttft_s
        return (self.completion_tokens - 1) / decode_s if decode_s > 0 else None

    def summary(self) -> str:
        parts = [f"TTFT {format_ms(1000 * self.ttft_s)}" if self.ttft_s is not None else "no tokens"]
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tokens/s")
        parts.append(f"{self.completion_tokens} tokens")
        if self.finish_reason:
            parts.append(f"finish: {self.finish_reason}")
        return " · ".join(parts)


STOPPED_WHILE_ANSWERING = "The engine stopped while answering; press Regenerate to try again."
MALFORMED = "The engine sent a reply this app could not read."


class ReplyError(Exception):
    """A failure already phrased for the user."""


def error_text(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except Exception:
        return response.text[:300] or f"HTTP {response.status_code}"


class ChatWorker(QObject):
    fitted = Signal(object)  # Fit, when the request was changed to fit the context (before any delta)
    context_used = Signal(int, int)  # tokens the chat holds, the model's max_model_len
    delta = Signal(str)
    reasoning_delta = Signal(str)
    finished = Signal(object)  # ChatResult
    failed = Signal(str)
    done = Signal()  # after finished or failed: the thread may quit

    def __init__(self, request: ChatRequest) -> None:
        super().__init__()
        self.request = request
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        try:
            self.finished.emit(self._stream())
        except httpx.ConnectError:
            self.failed.emit(f"Could not reach the engine at {self.request.base_url}; is it running? "
                             "Start it from the Engine tab.")
        except ReplyError as e:
            self.failed.emit(str(e))
        except httpx.TimeoutException:
            self.failed.emit("The engine did not answer in time (it may be overloaded); try again.")
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            self.failed.emit(STOPPED_WHILE_ANSWERING)
        except httpx.HTTPError as e:
            self.failed.emit(f"The request to the engine failed: {e}")
        except ValueError:  # JSON decoding of a chunk
            self.failed.emit(MALFORMED)
        finally:
            self.done.emit()

    def _stream(self) -> ChatResult:
        r = self.request
        result = ChatResult()
        start = time.perf_counter()
        timeout = httpx.Timeout(10.0, read=120.0)
        with httpx.Client(timeout=timeout, headers=auth_headers(r.api_key)) as client:
            body = r.body()
            if r.fit_context and r.has_images():
                result.max_model_len = r.max_model_len
            elif r.fit_context:
                fit = self._fit(client)
                body.update(messages=fit.messages, max_tokens=fit.max_tokens)
                if fit.max_model_len:
                    result.max_model_len = fit.max_model_len
                    self.context_used.emit(fit.prompt_tokens, fit.max_model_len)
                if fit.note():
                    self.fitted.emit(fit)
            with client.stream("POST", f"{r.base_url.rstrip('/')}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise ReplyError(f"The engine refused the request: {error_text(response)}")
                for payload in iter_sse_data(response):
                    if self._stop.is_set():
                        result.finish_reason = "stopped"
                        break
                    if payload.strip() == "[DONE]":
                        break
                    self._take_chunk(json.loads(payload), result, start)
                else:
                    if result.finish_reason is None:  # the stream ended without [DONE] or a finish reason
                        raise ReplyError(STOPPED_WHILE_ANSWERING)
        result.elapsed_s = time.perf_counter() - start
        result.model = result.model or r.model
        if result.usage.get("completion_tokens"):
            result.completion_tokens = int(result.usage["completion_tokens"])
        if result.max_model_len and result.usage.get("total_tokens"):
            self.context_used.emit(int(result.usage["total_tokens"]), result.max_model_len)
        return result

    def _fit(self, client: httpx.Client) -> Fit:
        r = self.request

        def count(messages: list[dict]) -> tuple[int, int] | None:
            response = client.post(f"{r.base_url.rstrip('/')}/tokenize",
                                   json={"model": r.model, "messages": messages, "add_generation_prompt": True})
            if response.status_code != 200:
                return None  # no /tokenize here (or it refused): the completion itself will say what is wrong
            answer = response.json()
            if not isinstance(answer.get("count"), int) or not isinstance(answer.get("max_model_len"), int):
                return None
            return answer["count"], answer["max_model_len"]

        try:
            return fit_to_context(r.messages, r.max_tokens, count)
        except ContextFull as exc:
            raise ReplyError(str(exc)) from exc

    def _take_chunk(self, chunk: dict, result: ChatResult, start: float) -> None:
        if chunk.get("error"):  # the server reports a failure after the stream started in-band
            raise ReplyError(f"The engine failed while answering: {chunk['error'].get('message', chunk['error'])}")
        if chunk.get("usage"):
            result.usage = chunk["usage"]
        if chunk.get("model") and not result.model:
            result.model = str(chunk["model"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                result.reasoning += reasoning
                self.reasoning_delta.emit(reasoning)
            content = delta.get("content")
            if content:
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - start
                result.last_token_s = time.perf_counter() - start
                result.text += content
                result.completion_tokens += 1
                self.delta.emit(content)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]


class ChatClient(QObject):
    """One streaming request at a time; signals fitted / delta / finished / failed on the GUI thread."""

    fitted = Signal(object)
    context_used = Signal(int, int)
    delta = Signal(str)
    reasoning_delta = Signal(str)
    finished = Signal(object)
    failed = Signal(str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._thread: QThread | None = None
        self._worker: ChatWorker | None = None
        self._retiring: list[tuple[QThread, ChatWorker]] = []

    def busy(self) -> bool:
        return self._thread is not None

    def send(self, request: ChatRequest) -> None:
        """Start streaming `request`; a previous request still winding down is stopped and silenced."""
        self._retire()
        self._worker = ChatWorker(request)
        self._thread = QThread()
        self._worker.moveToThread(self._thread)
        self._thread.started.connect(self._worker.run)
        self._worker.fitted.connect(self.fitted)
        self._worker.context_used.connect(self.context_used)
        self._worker.delta.connect(self.delta)
        self._worker.reasoning_delta.connect(self.reasoning_delta)
        self._worker.finished.connect(self.finished)
        self._worker.failed.connect(self.failed)
        self._worker.done.connect(self._thread.quit, Qt.ConnectionType.DirectConnection)
        thread = self._thread
        thread.finished.connect(lambda: self._on_thread_finished(thread))
        thread.start()

    def stop(self) -> None:
        if self._worker is not None:
            self._worker.stop()

    def _retire(self) -> None:
        if self._thread is None or self._worker is None:
            return
        self._worker.stop()
        for signal in (self._worker.fitted, self._worker.context_used, self._worker.delta, self._worker.reasoning_delta, self._worker.finished, self._worker.failed):
            signal.disconnect()
        self._retiring.append((self._thread, self._worker))
        self._thread = self._worker = None

    def _on_thread_finished(self, thread: QThread) -> None:
        if thread is self._thread:
            self._thread = self._worker = None
        self._retiring = [(t, w) for t, w in self._retiring if t is not thread]

    def wait_idle(self, timeout_ms: int = 5000) -> None:
        """For application exit only."""
        self._retire()
        for thread, _worker in self._retiring:
            thread.wait(timeout_ms)
        self._retiring.clear()
