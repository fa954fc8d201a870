"""The OpenAI-compatible HTTP server: FastAPI app factory (app.py), routes, protocol models, errors, metrics, state.

Imports FastAPI and pydantic, never Qt; the engine behind it is reached only through `AsyncEngine`. The package
itself imports nothing, so the torch-free pieces (auth, hosts, limits, errors, sse) can be imported by the router
(engine/entrypoints/router) without loading torch.
"""
