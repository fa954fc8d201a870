"""A chat choice's text as an OpenAI message or as stream deltas: reasoning, content and tool calls split.

`ChoiceView` reads the cumulative text of one choice each time it grows and returns only what is new
and settled: reasoning (`--reasoning-parser`), content, and tool calls, parsed with the model's tool
parser under tool_choice auto or read from the grammar-forced JSON under `required` / a named function.
A call's arguments stream in pieces while it is being written (forced calls, hermes); the non-streamed
message is the same view read once at the end, so streamed deltas always add up to it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from engine.reasoning import ReasoningParser
from engine.entrypoints.openai.responses import ChatMessageOut, DeltaMessage
from engine.tool_parsers import ToolCall, ToolParser
from engine.tool_parsers.base import make_call_id


@dataclass
class ChatOutputPlan:
    """How a request's choices are read: fixed per request."""

    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True
    tool_parser: ToolParser | None = None  # tool_choice auto with tools
    forced_name: str | None = None  # tool_choice named: the output is this function's arguments
    forced_required: bool = False  # tool_choice required: the output is a JSON list of calls
    max_calls: int | None = None  # 1 when parallel_tool_calls is false

    @property
    def needs_special_tokens(self) -> bool:
        """A parser reads special-token markers (harmony), so the output is detokenized with them."""
        return any(p is not None and p.needs_special_tokens for p in (self.reasoning, self.tool_parser))


_FORCED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


def _forced_calls(text: str) -> tuple[list[ToolCall], tuple[str, str] | None]:
    """The grammar-forced `[{"name": ..., "parameters": {...}}, ...]` of tool_choice required, read as far
    as it is written: complete calls (arguments as the model wrote them) and the call still open."""
    decoder, calls, i = json.JSONDecoder(), [], text.find("[") + 1
    while i > 0:
        head = _FORCED_HEAD.match(text, i)
        if head is None:
            return calls, None
        name = json.loads(f'"{head.group(1)}"')
        try:
            _, end = decoder.raw_decode(text, head.end())
        except json.JSONDecodeError:
            return calls, (name, text[head.end():].rstrip(" \t\r\n}]"))
        close = text.find("}", end)
        if close < 0:
            return calls, (name, text[head.end():end])
        calls.append(ToolCall(name, text[head.end():end]))
        i = close + 1
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
    return calls, None


@dataclass
class ChoiceView:
    plan: ChatOutputPlan
    sent_reasoning: int = 0
    sent_content: int = 0
    sent_arguments: int = 0
    calls: list[ToolCall] = field(default_factory=list)
    named_id: str = field(default_factory=make_call_id)
    streaming_call: tuple[str, int] | None = None  # (id, arguments sent) of a call whose arguments stream

    def _split(self, text: str, final: bool) -> tuple[str, str, list[ToolCall], tuple[str, str] | None]:
        """(reasoning, content, complete calls, the open call's name and arguments so far)."""
        plan = self.plan
        if plan.forced_required:
            calls, open_call = _forced_calls(text)
            return "", "", calls, None if final else open_call
        reasoning, content = plan.reasoning.split(text, final) if plan.reasoning else ("", text)
        calls: list[ToolCall] = []
        open_call = None
        parser = plan.tool_parser
        if parser is not None:
            start = parser.find_start(content)
            if start is None:
                content = content if final else content[:len(content) - parser.held_back(content)]
            else:
                parsed = parser.parse_calls(content[start:], final)
                if parsed is not None:
                    calls = parsed
                    open_call = None if final else parser.open_call(content[start:])
                if parsed or not final:
                    content = content[:start]
        return reasoning, content, calls, open_call

    def _call_deltas(self, calls: list[ToolCall], open_call: tuple[str, str] | None) -> list[dict]:
        """New complete calls whole (or the rest of the one whose arguments were streaming), then the open
        call's header and arguments pieces."""
        deltas = []
        for call in calls[len(self.calls):]:
            index = len(self.calls)
            if self.streaming_call is not None:
                call.id, sent = self.streaming_call
                deltas.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
                self.streaming_call = None
            else:
                deltas.append(dict(index=index, **call.to_openai()))
            self.calls.append(call)
        if open_call is not None and (self.plan.max_calls is None or len(self.calls) < self.plan.max_calls):
            name, args = open_call
            index = len(self.calls)
            if self.streaming_call is None:
                call_id = make_call_id()
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": name, "arguments": args}})
                self.streaming_call = (call_id, len(args))
            elif len(args) > self.streaming_call[1]:
                deltas.append({"index": index, "function": {"arguments": args[self.streaming_call[1]:]}})
                self.streaming_call = (self.streaming_call[0], len(args))
        return deltas

    def update(self, text: str, final: bool) -> DeltaMessage | None:
        """The delta since the last update (None when nothing new is settled)."""
        if self.plan.forced_name is not None:
            return self._named_delta(text)
        reasoning, content, calls, open_call = self._split(text, final)
        if self.plan.max_calls is not None:
            calls = calls[:self.plan.max_calls]
        delta = DeltaMessage()
        if reasoning[self.sent_reasoning:] and self.plan.include_reasoning:
            delta.reasoning_content = reasoning[self.sent_reasoning:]
        if content[self.sent_content:]:
            delta.content = content[self.sent_content:]
        delta.tool_calls = self._call_deltas(calls, open_call) or None
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        has = delta.reasoning_content or delta.content or delta.tool_calls
        return delta if has else None

    def _named_delta(self, text: str) -> DeltaMessage | None:
        first = not self.calls
        if first:
            self.calls.append(ToolCall(self.plan.forced_name, "", self.named_id))
        piece = text[self.sent_arguments:]
        self.sent_arguments = len(text)
        self.calls[0].arguments = text
        if not first and not piece:
            return None
        function = {"arguments": piece}
        if first:
            function = {"name": self.plan.forced_name, "arguments": piece}
        call = {"index": 0, "function": function}
        if first:
            call.update(id=self.named_id, type="function")
        return DeltaMessage(tool_calls=[call])

    def message(self, text: str) -> ChatMessageOut:
        """The whole choice as a non-streamed message (read once, final)."""
        delta = self.update(text, final=True) or DeltaMessage()
        return ChatMessageOut(content=delta.content if delta.content or not self.calls else None,
                              reasoning_content=delta.reasoning_content,
                              tool_calls=[c.to_openai() for c in self.calls])


def finish_reason(reason: str | None, view: ChoiceView) -> str | None:
    return "tool_calls" if reason == "stop" and view.calls else reason


def api_stop_reason(stop_reason: int | str | None, stop_token_ids: list[int] | None) -> int | str | None:
    """vLLM's `stop_reason`: the stop string, or the request's stop token, that ended the choice; None when the
    model's own end-of-sequence token (or a finished grammar) ended it."""
    if isinstance(stop_reason, int) and stop_reason not in (stop_token_ids or ()):
        return None
    return stop_reason
