"""Run tokenizer work (encode, chat templates, decode) off the event loop, in two bounded thread pools.

Tokenizing is CPU work that can take seconds for a multi-megabyte body, so it never runs on the event
loop (where it would stall /health and every stream). Small jobs get a few threads of their own;
large ones share one thread, so a burst of huge prompts queues behind itself, holds the memory of
one at a time, and never delays a short chat.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from engine.platform.threads import thread_budget

SMALL_JOB_CHARS = 32 * 1024  # up to this many characters (or ids) a job is "small"
_small = ThreadPoolExecutor(max_workers=thread_budget().server_threads, thread_name_prefix="pagedesk-tokenize")
_large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedesk-tokenize-large")


async def off_loop(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in the pool for a job of `size` characters (or token ids), awaited without blocking the loop."""
    pool = _small if size <= SMALL_JOB_CHARS else _large
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
