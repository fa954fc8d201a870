"""The Responses API's output side: reply blocks as output items, their typed stream events, the Response object.

Each block of the reply (output_blocks.py) is one output item: reasoning → a `reasoning` item with one
reasoning_text part, content → an assistant `message` with one output_text part, a tool call → a
`function_call` item. A stream sends, per item, output_item.added, (content_part.added), the deltas, the
`.done` events and output_item.done, numbered by sequence_number, between response.created /
response.in_progress and response.completed (response.incomplete when max_output_tokens cut the reply), in
the order OpenAI sends them and the openai SDK's stream helper accumulates.
"""
from __future__ import annotations

import uuid
from typing import Any

from engine.entrypoints.openai.output_blocks import Block, BlockEvent
from engine.entrypoints.openai.protocol_responses import ResponsesRequest
from engine.entrypoints.openai.responses_tools import ResponsesTools, flat_name


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


class ResponseItems:
    """Output items built from block events, and the stream events that build them."""

    def __init__(self, tools: ResponsesTools | None = None) -> None:
        self.tools = tools or ResponsesTools()
        self.items: list[dict[str, Any]] = []
        self.sequence = 0
        self._ids: dict[int, str] = {}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return body

    @staticmethod
    def _part(block: Block) -> dict[str, Any]:
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": block.text}
        return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}

    def item(self, block: Block, status: str) -> dict[str, Any]:
        item_id = self._ids[block.index]
        if block.kind == "call":
            return {"id": item_id, "type": "function_call", "call_id": block.call_id,
                    **self.tools.call_item_names(block.name), "arguments": block.text, "status": status}
        parts = [self._part(block)] if status != "in_progress" else []
        if block.kind == "reasoning":
            return {"id": item_id, "type": "reasoning", "summary": [], "content": parts, "status": status}
        return {"id": item_id, "type": "message", "role": "assistant", "content": parts, "status": status}

    def render(self, ev: BlockEvent, status: str = "completed") -> list[dict[str, Any]]:
        """The stream events of one block event (`status`: the closed item's, completed or incomplete)."""
        block = ev.block
        if ev.action == "open":
            self._ids[block.index] = new_id(_PREFIX[block.kind])
            self.items.append(self.item(block, "in_progress"))
            events = [self.event("response.output_item.added", output_index=block.index,
                                 item=self.item(block, "in_progress"))]
            if block.kind != "call":
                empty = {**self._part(block), "text": ""}
                events.append(self.event("response.content_part.added", item_id=self._ids[block.index],
                                         output_index=block.index, content_index=0, part=empty))
            return events
        ids = dict(item_id=self._ids[block.index], output_index=block.index)
        if ev.action == "append":
            if block.kind == "call":
                return [self.event("response.function_call_arguments.delta", delta=ev.piece, **ids)]
            if block.kind == "reasoning":
                return [self.event("response.reasoning_text.delta", content_index=0, delta=ev.piece, **ids)]
            return [self.event("response.output_text.delta", content_index=0, delta=ev.piece, logprobs=[], **ids)]
        self.items[block.index] = done = self.item(block, status)
        if block.kind == "call":
            events = [self.event("response.function_call_arguments.done", arguments=block.text,
                                 **self.tools.call_item_names(block.name), **ids)]
        else:
            kind = "response.reasoning_text.done" if block.kind == "reasoning" else "response.output_text.done"
            extra = {} if block.kind == "reasoning" else {"logprobs": []}
            events = [self.event(kind, content_index=0, text=block.text, **extra, **ids),
                      self.event("response.content_part.done", content_index=0, part=self._part(block), **ids)]
        return events + [self.event("response.output_item.done", output_index=block.index, item=done)]


def response_object(response_id: str, created: int, model: str, req: ResponsesRequest, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None, tools: ResponsesTools,
                    completed_at: int | None = None) -> dict[str, Any]:
    """The Response object with every field of Open Responses' ResponseResource (status in_progress with no output
    and no usage at the start of a stream); sampling values are the ones used, defaults included."""
    return {
        "id": response_id, "object": "response", "created_at": created, "completed_at": completed_at,
        "status": status, "model": model, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "tools": tools.echo, "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls is not False, "text": _text(req),
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "presence_penalty": req.presence_penalty or 0.0, "frequency_penalty": req.frequency_penalty or 0.0,
        "top_logprobs": req.top_logprobs or 0, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort, "summary": req.reasoning.summary} if req.reasoning else None,
        "truncation": req.truncation or "disabled", "store": req.store is not False, "metadata": req.metadata or {},
        "user": req.user, "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
        "background": False, "service_tier": "default", "usage": usage,
    }


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return "auto"
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {k: choice[k] for k in ("type", "name", "namespace") if k in choice}
    return choice


def _text(req: ResponsesRequest) -> dict[str, Any]:
    fmt = dict(req.text.format) if req.text and req.text.format else {"type": "text"}
    if fmt.get("type") == "json_schema":  # Open Responses lists description and strict always
        fmt = {"description": None, "strict": False, **fmt}
    text: dict[str, Any] = {"format": fmt}
    if req.text and req.text.verbosity:
        text["verbosity"] = req.text.verbosity
    return text


def usage_object(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def conversation_turn(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's items as the chat messages a chained request continues from (reasoning left out)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": flat_name(item["name"], item.get("namespace")), "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
