"""ServerContext: what every route needs (the AsyncEngine, the served model, the API key, the metrics).

One context per app, kept on `app.state`, so several servers can live in one process. The served
model is built on first use after the engine loaded; before that, and after the engine died, routes
that need it answer 503.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.openai.errors import OpenAIError, engine_error
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.entrypoints.openai.responses_store import ResponseStore
from engine.entrypoints.openai.served_model import ServedModel
from engine.entrypoints.openai.state_hub import SnapshotHub


@dataclass
class ServerContext:
    async_engine: AsyncEngine
    served_name: str
    api_key: str | None
    metrics: ServerMetrics
    _served: ServedModel | None = None
    snapshots: SnapshotHub | None = None  # the engine-state snapshots every reader shares (routes_state)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' previous_response_id

    def served_model(self) -> ServedModel:
        try:
            self.async_engine.check_serving()
        except Exception as exc:  # noqa: BLE001 - loading/dead become 503
            raise engine_error(exc) from None
        if self._served is None:
            self._served = ServedModel.from_engine(self.served_name, self.async_engine.engine)
        return self._served

    def model_for(self, requested: str | None) -> ServedModel:
        """The served model if `requested` names it (or is unset); 404 otherwise."""
        if requested is not None and requested != self.served_name:
            raise OpenAIError(404, f"The model `{requested}` does not exist; this server serves "
                                   f"`{self.served_name}`", "model", "model_not_found")
        return self.served_model()


def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx
