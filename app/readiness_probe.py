"""ReadinessProbe: READY means the served model answers a request, never only that a port is open.

It polls the endpoint on the GUI event loop (QNetworkAccessManager, one request in flight, nothing blocks):
GET /health until it answers 200 (a one-engine server answers 503 while its model loads; the router answers at
once, which `endpoint_up` reports), then GET /v1/models for the main model's own state (the router says
loading, loaded, or failed with its engine's error; a one-engine server lists its model without a state),
then a completion of one token for it, which behind the router also loads it. A 200 emits `answered` and the
probe stops. A model the router lists as failed, or a probe answered with an error, emits `failed` with the
server's own words, once; the probe then only watches /v1/models and asks again when the model is listed as
loaded (someone pressed Load), so a model that cannot load is never relaunched in a loop. An embedding
model (`--task embed`) answers a completion with its 400 that says to use /v1/embeddings: that answer is
its engine answering too.
"""
from __future__ import annotations

import json

from PySide6.QtCore import QByteArray, QObject, QTimer, QUrl, Signal
from PySide6.QtNetwork import QNetworkAccessManager, QNetworkReply, QNetworkRequest

HEALTH, MODELS, PROBE, WATCH = "health", "models", "probe", "watch"
FAILED_STATES = ("failed", "dead")
LOAD_TIMEOUT_MS = 900_000  # the probe waits for the model to load behind the router (the router's own bound)
WATCH_MS = 1000


class ReadinessProbe(QObject):
    endpoint_up = Signal()  # /health answered 200: the router (or the engine) listens
    progress = Signal(str)  # what the probe waits for: "loading", "first request"
    answered = Signal()  # the main model answered a request: READY
    failed = Signal(str)  # the main model cannot serve: the router's error or the probe's answer

    def __init__(self, interval_ms: int = 250, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._manager = QNetworkAccessManager(self)
        self._interval_ms = interval_ms
        self._timer = QTimer(self, interval=interval_ms, timeout=self._poll)
        self._reply: QNetworkReply | None = None
        self._base = ""
        self.model: str | None = None
        self.api_key: str | None = None
        self.phase = HEALTH
        self.failure = ""

    def start(self, base_url: str, model: str | None = None, api_key: str | None = None) -> None:
        """Probe `model` (None: the first model the endpoint lists) at `base_url` with the endpoint's key."""
        self.stop()
        self._base, self.model, self.api_key = base_url.rstrip("/"), model, api_key
        self.phase, self.failure = HEALTH, ""
        self._timer.start(self._interval_ms)

    def stop(self) -> None:
        self._timer.stop()
        if self._reply is not None:
            reply, self._reply = self._reply, None
            reply.abort()
            reply.deleteLater()

    def is_polling(self) -> bool:
        return self._timer.isActive()

    # ---- one request at a time ------------------------------------------------------------------------------
    def _request(self, path: str, timeout_ms: int = 2000) -> QNetworkRequest:
        request = QNetworkRequest(QUrl(self._base + path))
        request.setTransferTimeout(timeout_ms)
        if self.api_key:
            request.setRawHeader(QByteArray(b"Authorization"), QByteArray(f"Bearer {self.api_key}".encode()))
        return request

    def _poll(self) -> None:
        if self._reply is not None:
            return
        if self.phase == HEALTH:
            self._reply = self._manager.get(self._request("/health"))
        elif self.phase in (MODELS, WATCH):
            self._reply = self._manager.get(self._request("/v1/models"))
        else:
            request = self._request("/v1/completions", LOAD_TIMEOUT_MS)
            request.setHeader(QNetworkRequest.KnownHeaders.ContentTypeHeader, "application/json")
            body = {"model": self.model, "prompt": "Hi", "max_tokens": 1, "temperature": 0.0}
            self._reply = self._manager.post(request, QByteArray(json.dumps(body).encode()))
        self._reply.finished.connect(self._on_finished)

    def _on_finished(self) -> None:
        reply, self._reply = self._reply, None
        if reply is None or reply is not self.sender():
            return
        status = reply.attribute(QNetworkRequest.Attribute.HttpStatusCodeAttribute)
        body = bytes(reply.readAll().data())
        transport_error = reply.error() != QNetworkReply.NetworkError.NoError and status is None
        reply.deleteLater()
        if not self._timer.isActive():
            return
        if transport_error:  # nothing listens (yet, or any more): from the start
            self.phase = HEALTH if self.phase != WATCH else WATCH
            return
        {HEALTH: self._on_health, MODELS: self._on_models, WATCH: self._on_models, PROBE: self._on_probe}[
            self.phase](int(status), _json(body))

    def _on_health(self, status: int, answer: dict) -> None:
        if status == 200:
            self.endpoint_up.emit()
            self.phase = MODELS
        elif _error(answer).get("code") == "model_loading":
            self.progress.emit("loading")

    def _on_models(self, status: int, answer: dict) -> None:
        if status != 200:
            self._fail(f"GET /v1/models answered HTTP {status}: {_error(answer).get('message', '')}".rstrip(": "))
            return
        cards = [c for c in answer.get("data") or [] if isinstance(c, dict)]
        card = next((c for c in cards if c.get("id") == self.model), cards[0] if len(cards) == 1 or
                    self.model is None and cards else None)
        if card is None:
            self._fail(f"the endpoint does not list {self.model}: it serves {[c.get('id') for c in cards]}")
            return
        self.model = str(card.get("id"))
        state = card.get("state") or ("loaded" if card.get("loaded", True) else "unloaded")
        if state in FAILED_STATES:
            errors = [e.get("error") for e in card.get("engines") or [] if e.get("error")]
            self._fail(errors[0] if errors else card.get("config_error") or f"{self.model} failed to load")
        elif state == "loading":
            self.progress.emit("loading")
        elif self.phase == MODELS or state == "loaded":  # unloaded: the probe itself loads it behind the router
            self.progress.emit("first request")
            self.phase = PROBE
            self._poll()

    def _on_probe(self, status: int, answer: dict) -> None:
        message = str(_error(answer).get("message", ""))
        if status == 200 or (status == 400 and "/v1/embeddings" in message):
            self._timer.stop()
            self.answered.emit()
            return
        self._fail(f"{self.model} did not answer: HTTP {status}" + (f": {message}" if message else ""))

    def _fail(self, message: str) -> None:
        """Say it once, then only watch /v1/models (slowly) for the model to be loaded."""
        self.phase = WATCH
        self._timer.setInterval(WATCH_MS)
        if message != self.failure:
            self.failure = message
            self.failed.emit(message)


def _json(body: bytes) -> dict:
    try:
        answer = json.loads(body) if body else {}
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _error(answer: dict) -> dict:
    error = answer.get("error")
    return error if isinstance(error, dict) else {}
