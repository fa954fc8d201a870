"""OpenAI's harmony format (gpt-oss): the reply as messages on channels, read from the detokenized text.

After the prompt's `<|start|>assistant` the model writes messages `[<|start|>assistant][ to=RECIPIENT]
<|channel|>CHANNEL[ <|constrain|>json]<|message|>BODY` ending in `<|end|>`, `<|call|>` (a tool call) or
`<|return|>` (the answer is done). `analysis` carries the reasoning, `final` (and a `commentary` message
without a recipient: a preamble) the answer, and a message `to=functions.NAME` a tool call whose body is
its arguments JSON. These markers are special tokens, so a request read with this parser is detokenized
with skip_special_tokens off (`needs_special_tokens`). `HarmonyReasoningParser.split` gives the analysis
text as reasoning and the answer as content, with each tool-call message after it in one canonical form
(`<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>ARGS<|call|>`) that the harmony
tool parser reads; a partial marker or header is held back until the next token decides it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.reasoning.base import ReasoningParser, held_back

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyMessage:
    start: int  # where its header begins in the text
    header_done: bool  # `<|message|>` seen: channel and recipient are known
    channel: str | None = None
    recipient: str | None = None
    body: str = ""  # so far, without a terminator (or a tail that may be the start of one)
    done: bool = False  # its terminator was seen
    raw: str = ""  # the header text as written (for a message that is not harmony after all)


def _held_back_any(text: str) -> int:
    return max(held_back(text, t) for t in TERMINATORS)


def read_messages(text: str, final: bool) -> list[HarmonyMessage]:
    messages, pos = [], 0
    while pos < len(text):
        body_at = text.find(MESSAGE, pos)
        if body_at < 0:
            messages.append(HarmonyMessage(pos, False, raw=text[pos:]))
            break
        header = text[pos:body_at]
        start = pos + header.rfind(START) if START in header else pos  # text before a <|start|> is stray
        header = text[start:body_at]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        message = HarmonyMessage(start, True, channel.group(1) if channel else None,
                                 recipient.group(1) if recipient else None, raw=header)
        body_at += len(MESSAGE)
        ends = [(i, t) for i, t in ((text.find(t, body_at), t) for t in TERMINATORS) if i >= 0]
        if ends:
            end, terminator = min(ends)
            message.body, message.done, pos = text[body_at:end], True, end + len(terminator)
        else:
            body = text[body_at:]
            message.body, pos = (body if final else body[:len(body) - _held_back_any(body)]), len(text)
        messages.append(message)
    return messages


def canonical_call(recipient: str, body: str, done: bool) -> str:
    return f"{START}assistant to={recipient}{CHANNEL}commentary{MESSAGE}{body}{CALL if done else ''}"


class HarmonyReasoningParser(ReasoningParser):
    """openai_gptoss (vLLM's name): analysis → reasoning, final / commentary → content, calls kept for the
    tool parser."""

    name = "openai_gptoss"
    needs_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        for m in read_messages(text, final):
            if not m.header_done:
                if final:  # the model did not write harmony here: show what it wrote
                    content.append(m.raw)
            elif m.recipient is not None:
                content.append(canonical_call(m.recipient, m.body, m.done))
            elif m.channel == "analysis":
                reasoning.append(m.body)
            else:
                content.append(m.body)
        return "".join(reasoning), "".join(content)
