"""GET (and HEAD) /health, GET (and HEAD) /metrics and GET /v1/models: readiness, Prometheus text, and the served model's card.

/health answers 200 only when the engine is loaded and alive; 503 (in the error shape) while it
loads or after it died, so a supervisor can wait on it. It needs no key, so its 503 says only which
state the engine is in; the cause (with pids and paths) is in the server log and in the 503s of
routes that need the key.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.errors import error_response
from engine.entrypoints.openai.responses import ModelCard, ModelList

open_router = APIRouter()  # no API key
router = APIRouter()


@open_router.head("/health", include_in_schema=False)  # probes; the schema lists the GET
@open_router.get("/health")
async def health(ctx: ServerContext = Depends(get_context)) -> Response:
    engine = ctx.async_engine
    if engine.ready:
        return JSONResponse({"status": "ok"})
    if engine.status == "loading":
        return error_response(503, "the model is still loading", code="model_loading")
    return error_response(503, f"the engine is not running ({engine.status}); the server log says why",
                          code="engine_dead")


@open_router.head("/metrics", include_in_schema=False)
@open_router.get("/metrics", response_class=PlainTextResponse,
                 responses={200: {"description": "Prometheus text exposition format"}})
async def metrics(ctx: ServerContext = Depends(get_context)) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: ServerContext = Depends(get_context)) -> ModelList:
    engine = ctx.async_engine
    if engine.ready:
        model = ctx.served_model()
        card = ModelCard(id=model.name, created=model.created, root=model.root, max_model_len=model.max_model_len,
                         context_length=model.max_model_len, quantization=model.quantization,
                         input_modalities=["text", "image"] if model.supports_images else ["text"])
    else:
        card = ModelCard(id=ctx.served_name, created=0, root=str(engine.config.model))
    return ModelList(data=[card])
