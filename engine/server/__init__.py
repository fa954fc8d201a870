"""The OpenAI-compatible HTTP server: FastAPI app factory, routes, protocol models, errors, metrics, state.

Imports FastAPI and pydantic, never Qt; the engine behind it is reached only through `AsyncEngine`.
"""
from engine.server.app import create_app

__all__ = ["create_app"]
