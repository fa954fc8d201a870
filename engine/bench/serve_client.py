"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk (torch-free).

A request's TTFT is the time from sending it to the first chunk that carries generated text; each later
text chunk adds one inter-token latency (ITL) — a chunk may hold more than one token when the server's
detokenizer holds text back, the same definition `vllm bench serve` uses. The output token count comes
and the prompt token count come from the final `usage` chunk (`stream_options.include_usage`) when the
server sends one (so word-built text prompts are counted exactly).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from engine.bench.serve_dataset import ServeRequest


@dataclass(slots=True)
class RequestOutcome:
    prompt_len: int
    output_len_asked: int
    start: float = 0.0  # perf_counter when sent
    ttft: float | None = None  # seconds
    itls: list[float] = field(default_factory=list)  # seconds between successive text chunks
    e2e: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None


def request_body(req: ServeRequest, model: str, endpoint: str, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension: every request generates exactly output_len tokens
    if endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts: pass --tokenizer for synthetic prompts")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client: httpx.AsyncClient, url: str, body: dict, endpoint: str,
                       outcome: RequestOutcome) -> RequestOutcome:
    """Stream one request into `outcome`; any failure (status, transport, in-band error) becomes `error`."""
    outcome.start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                outcome.error = f"HTTP {response.status_code}: {text[:200]}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = f"stream error: {str(chunk['error'])[:200]}"
                    return outcome
                if chunk.get("usage"):  # the server's own counts beat our estimates
                    outcome.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    outcome.prompt_len = int(chunk["usage"].get("prompt_tokens") or outcome.prompt_len)
                if not _chunk_text(chunk, endpoint):
                    continue
                now = time.perf_counter()
                if outcome.ttft is None:
                    outcome.ttft = now - outcome.start
                else:
                    outcome.itls.append(now - last)
                last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        return outcome
    outcome.e2e = time.perf_counter() - outcome.start
    outcome.output_tokens = outcome.output_tokens or chunks
    if outcome.ttft is None:
        outcome.error = "the stream ended without generated text"
    return outcome
