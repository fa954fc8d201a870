"""The OpenAI-compatible HTTP server: FastAPI app factory, routes, protocol models, errors, metrics, state.

Imports FastAPI and pydantic, never Qt; the engine behind it is reached only through `AsyncEngine`.
`create_app` is imported on first use, so the torch-free pieces (auth, hosts, limits, errors, sse) can be
imported by the router (engine/router) without loading torch.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from engine.server.app import create_app
        return create_app
    raise AttributeError(f"module 'engine.server' has no attribute {name!r}")
