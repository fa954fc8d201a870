"""OutputBlocks: one choice's stream of chat deltas as a sequence of typed blocks (reasoning, text, tool call).

The Responses API (output items) and Anthropic's Messages API (content blocks) both show a reply as an
ordered list of blocks, each opened, grown and closed; chat's `ChoiceView` deltas carry reasoning, content
and tool-call pieces side by side. `feed` turns each delta into open/append/close events in output order
(a change of kind closes the open block), so the streamed events and the non-streamed list (the same
view read once, then fed whole) always agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.entrypoints.openai.responses import DeltaMessage

Kind = Literal["reasoning", "text", "call"]


@dataclass
class Block:
    kind: Kind
    index: int  # position among the reply's blocks
    text: str = ""  # reasoning or content text; a call's arguments JSON text
    name: str | None = None  # a call's function name
    call_id: str | None = None


@dataclass
class BlockEvent:
    action: Literal["open", "append", "close"]
    block: Block
    piece: str = ""  # what an append added


class OutputBlocks:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._by_call: dict[int, Block] = {}  # the delta's tool-call index -> its block

    def _close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("close", block)]

    def _start(self, kind: Kind, name: str | None = None, call_id: str | None = None) -> list[BlockEvent]:
        events = self._close()
        self._open = Block(kind, len(self.blocks), name=name, call_id=call_id)
        self.blocks.append(self._open)
        return events + [BlockEvent("open", self._open)]

    def _append(self, block: Block, piece: str) -> list[BlockEvent]:
        if not piece:
            return []
        block.text += piece
        return [BlockEvent("append", block, piece)]

    def _text(self, kind: Kind, piece: str | None) -> list[BlockEvent]:
        if not piece:
            return []
        events = [] if self._open is not None and self._open.kind == kind else self._start(kind)
        return events + self._append(self._open, piece)

    def feed(self, delta: DeltaMessage | None) -> list[BlockEvent]:
        if delta is None:
            return []
        events = self._text("reasoning", delta.reasoning_content) + self._text("text", delta.content)
        for call in delta.tool_calls or []:
            function = call.get("function") or {}
            block = self._by_call.get(call["index"])
            if block is None:  # a call's first delta carries its id and name
                events += self._start("call", function.get("name"), call.get("id"))
                block = self._by_call[call["index"]] = self._open
            events += self._append(block, function.get("arguments") or "")
        return events

    def finish(self) -> list[BlockEvent]:
        """Close the last block (the choice finished)."""
        return self._close()
