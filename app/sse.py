"""Server-sent events from an httpx streaming response: yields each event's `data:` payload.

One implementation shared by the stats client and the chat client. Multi-line data fields are
joined with newlines, comments and other fields are skipped, as the SSE spec says.
"""
from __future__ import annotations

from collections.abc import Iterator

import httpx


def iter_sse_data(response: httpx.Response) -> Iterator[str]:
    data: list[str] = []
    for line in response.iter_lines():
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
