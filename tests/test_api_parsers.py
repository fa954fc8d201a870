"""Tool-call and reasoning parsers on model-shaped text: whole outputs, and token-by-token streams whose
deltas must add up to the whole-output message with no tool-call text leaking into content."""
from __future__ import annotations

import json

import pytest

from engine.reasoning import get_reasoning_parser
from engine.entrypoints.openai.chat_outputs import ChatOutputPlan, ChoiceView
from engine.tool_parsers import detect_tool_parser, get_tool_parser

WEATHER = {"city": "Paris", "unit": "c"}

CASES = {
    "hermes": ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
               "Let me check.", [("get_weather", WEATHER), ("get_time", {})]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
                    '{"name": "get_time", "parameters": {}}', "", [("get_weather", WEATHER), ("get_time", {})]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
                '{"name": "get_time", "arguments": {}}]', "", [("get_weather", WEATHER), ("get_time", {})]),
}


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _stream(plan: ChatOutputPlan, text: str, step: int = 3) -> tuple[str, str, list[dict]]:
    """Feed `text` in pieces of `step` characters; return the concatenated content, reasoning and calls
    (fragments joined as a client does: id and name once per index, arguments appended)."""
    view, content, reasoning, calls = ChoiceView(plan), "", "", []
    for end in range(step, len(text) + step, step):
        delta = view.update(text[:end], final=end >= len(text))
        if delta is not None:
            content += delta.content or ""
            reasoning += delta.reasoning_content or ""
            for frag in delta.tool_calls or []:
                if frag["index"] == len(calls):
                    assert frag["id"].startswith("call_") and frag["function"]["name"]
                    calls.append({"id": frag["id"], "function": dict(frag["function"]), "pieces": 1})
                else:
                    assert frag["index"] == len(calls) - 1 and "id" not in frag and "name" not in frag["function"]
                    calls[-1]["function"]["arguments"] += frag["function"]["arguments"]
                    calls[-1]["pieces"] += 1
    return content, reasoning, calls


@pytest.mark.parametrize("name", list(CASES))
def test_tool_parser_whole_and_streamed_agree(name):
    text, content, expected = CASES[name]
    message = ChoiceView(ChatOutputPlan(tool_parser=get_tool_parser(name))).message(text)
    assert (message.content or "") == content
    assert _calls(message.tool_calls) == expected
    streamed_content, _, streamed_calls = _stream(ChatOutputPlan(tool_parser=get_tool_parser(name)), text)
    assert streamed_content == content and "{" not in streamed_content
    assert _calls(streamed_calls) == expected
    assert [c["function"]["arguments"] for c in streamed_calls] == [c["function"]["arguments"]
                                                                     for c in message.tool_calls]
    if name == "hermes":  # name-first calls stream their arguments in pieces
        assert streamed_calls[0]["pieces"] > 3


@pytest.mark.parametrize("name", list(CASES))
def test_text_that_only_looks_like_a_call_stays_content(name):
    text = {"hermes": "See <tool_call>not json</tool_call>", "llama3_json": "{not json",
            "mistral": "[TOOL_CALLS] oops"}[name]
    plan = ChatOutputPlan(tool_parser=get_tool_parser(name))
    assert ChoiceView(plan).message(text).content == text
    assert _stream(ChatOutputPlan(tool_parser=get_tool_parser(name)), text)[0] == text


def test_parallel_tool_calls_false_keeps_one_call():
    text = CASES["hermes"][0]
    message = ChoiceView(ChatOutputPlan(tool_parser=get_tool_parser("hermes"), max_calls=1)).message(text)
    assert _calls(message.tool_calls) == [("get_weather", WEATHER)]


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("deepseek_r1", "I think.\nMore.</think>\n\nThe answer is 4.", "I think.\nMore.", "\n\nThe answer is 4."),
    ("deepseek_r1", "<think>hmm</think>4", "hmm", "4"),
    ("deepseek_r1", "still thinking <", "still thinking <", ""),
    ("qwen3", "<think>hmm</think>4", "hmm", "4"),
    ("qwen3", "No thinking here: 4 < 5", "", "No thinking here: 4 < 5"),
])
def test_reasoning_parsers(name, text, reasoning, content):
    plan = ChatOutputPlan(reasoning=get_reasoning_parser(name))
    message = ChoiceView(plan).message(text)
    assert (message.reasoning_content or "", message.content or "") == (reasoning, content)
    for step in (1, 4):
        got_content, got_reasoning, _ = _stream(ChatOutputPlan(reasoning=get_reasoning_parser(name)), text, step)
        assert (got_reasoning, got_content) == (reasoning, content)


def test_reasoning_then_tool_call():
    plan = ChatOutputPlan(reasoning=get_reasoning_parser("qwen3"), tool_parser=get_tool_parser("hermes"))
    text = '<think>use the tool</think><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, reasoning, calls = _stream(plan, text, 2)
    assert (content, reasoning, _calls(calls)) == ("", "use the tool", [("get_time", {})])


def test_named_tool_choice_streams_arguments_in_pieces():
    args = json.dumps(WEATHER)
    view = ChoiceView(ChatOutputPlan(forced_name="get_weather"))
    pieces = [view.update(args[:end], end >= len(args)) for end in range(4, len(args) + 4, 4)]
    first = pieces[0].tool_calls[0]
    assert first["function"] == {"name": "get_weather", "arguments": args[:4]} and first["id"].startswith("call_")
    joined = "".join(p.tool_calls[0]["function"]["arguments"] for p in pieces if p is not None)
    assert joined == args and all("name" not in p.tool_calls[0]["function"] for p in pieces[1:] if p)


def test_parser_detected_from_chat_template():
    assert detect_tool_parser("...<tool_call>...") == "hermes"
    assert detect_tool_parser("...[TOOL_CALLS]...") == "mistral"
    assert detect_tool_parser("...<|python_tag|>...") == "llama3_json"
    assert detect_tool_parser("{{ messages }}") is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


def test_required_tool_calls_stream_in_pieces():
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, '
            '{"name": "get_time", "parameters": {}}]')
    message = ChoiceView(ChatOutputPlan(forced_required=True)).message(text)
    assert _calls(message.tool_calls) == [("get_weather", WEATHER), ("get_time", {})] and message.content is None
    _, _, calls = _stream(ChatOutputPlan(forced_required=True), text, 4)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls]
    assert calls[0]["pieces"] > 3
