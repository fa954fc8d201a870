"""The router: one public endpoint in front of several engine processes (models, replicas of a model).

Each engine is today's `pagedesk-serve` on a private loopback port; the router maps a request's `model` to
one of them, loads engines on first use and unloads idle ones, places them on cards with the capacity planner
and relays responses (SSE unbuffered). It never imports torch or the engine, not even inside a function (an import
contract in pyproject.toml): it is a FastAPI + httpx process that starts engines as processes
(engine/entrypoints/router_engine.py) and reads models only through the torch-free config and planning modules.
"""
