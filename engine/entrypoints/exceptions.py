"""What the async engine raises to the servers in front of it.

Standard library only: the OpenAI error mapping (openai/errors.py), which the router installs too, tells these
apart without importing the engine, so the router stays free of torch.
"""


class EngineNotReadyError(RuntimeError):
    """The model is still loading."""


class EngineDeadError(RuntimeError):
    """The engine failed (at load or in a step) and serves nothing more."""


class RequestFailedError(RuntimeError):
    """The engine failed one request (its blocks are freed); it goes on serving the others."""


class StreamIdleTimeout(RuntimeError):
    """The caller left the request's output unread for --stream-idle-timeout seconds: it was aborted."""
