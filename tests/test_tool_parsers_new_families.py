"""The tool-call formats of the new families on model-shaped text, whole and streamed token by token (deltas must
add up to the whole message, no call text leaking into content): qwen3_coder's XML-style calls (values typed
by the request's tool schema) and gpt-oss's harmony channels (analysis → reasoning, final → content,
`to=functions.NAME` → calls), plus their detection from chat templates."""
from __future__ import annotations

import json

import pytest

from engine.reasoning import detect_reasoning_parser, get_reasoning_parser
from engine.entrypoints.openai.chat_outputs import ChatOutputPlan, ChoiceView
from engine.entrypoints.openai.protocol import ToolDefinition
from engine.tool_parsers import detect_tool_parser, get_tool_parser
from test_api_parsers import _calls, _stream

TOOLS = [ToolDefinition.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "zip": {"type": "string"}, "metric": {"type": "boolean"},
                                     "hours": {"type": "array", "items": {"type": "integer"}}}}}}),
         ToolDefinition.model_validate({"type": "function", "function": {"name": "get_time"}})]

QWEN3_CODER = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n<parameter=metric>\nTrue\n"
               "</parameter>\n<parameter=hours>\n[6, 12]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
               "<function=get_time>\n</function>\n</tool_call>")
WEATHER = {"city": "Paris", "days": 3, "zip": "75001", "metric": True, "hours": [6, 12]}

HARMONY_CALL = ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>"
                "commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
                'commentary <|constrain|>json<|message|>{"city": "Paris", "unit": "c"}<|call|>')
HARMONY_FINAL = ("<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "Hello <there>!<|return|>")


def _coder_plan() -> ChatOutputPlan:
    parser = get_tool_parser("qwen3_coder")
    parser.bind_tools(TOOLS)
    return ChatOutputPlan(tool_parser=parser)


def _harmony_plan() -> ChatOutputPlan:
    return ChatOutputPlan(reasoning=get_reasoning_parser("openai_gptoss"), tool_parser=get_tool_parser("openai"))


@pytest.mark.parametrize("step", [1, 4, 11])
def test_qwen3_coder_whole_and_streamed_agree(step):
    message = ChoiceView(_coder_plan()).message(QWEN3_CODER)
    assert message.content == "Let me check.\n"
    assert _calls(message.tool_calls) == [("get_weather", WEATHER), ("get_time", {})]
    assert list(json.loads(message.tool_calls[0]["function"]["arguments"])) == list(WEATHER)  # the model's order
    content, _, calls = _stream(_coder_plan(), QWEN3_CODER, step)
    assert content == "Let me check.\n" and "<" not in content
    assert [c["function"]["arguments"] for c in calls] == [c["function"]["arguments"] for c in message.tool_calls]
    assert calls[0]["pieces"] > 2  # the arguments streamed parameter by parameter


def test_qwen3_coder_untyped_values_and_non_calls():
    parser = get_tool_parser("qwen3_coder")  # no tools bound: JSON when it parses, else text
    [call] = parser.parse_calls("<tool_call><function=f><parameter=n>\n7\n</parameter><parameter=s>\nhi there\n"
                                "</parameter></function></tool_call>", final=True)
    assert (call.name, json.loads(call.arguments)) == ("f", {"n": 7, "s": "hi there"})
    text = "I would use <tool_call> tags here, but no."
    assert ChoiceView(_coder_plan()).message(text).content == text  # not a call: it stays content
    unclosed = "<tool_call>\n<function=get_time>\n"  # cut by EOS: the open function still counts
    assert _calls(ChoiceView(_coder_plan()).message(unclosed).tool_calls) == [("get_time", {})]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_harmony_call_whole_and_streamed_agree(step):
    message = ChoiceView(_harmony_plan()).message(HARMONY_CALL)
    assert message.reasoning_content == "The user wants the weather." and message.content == "Checking."
    assert _calls(message.tool_calls) == [("get_weather", {"city": "Paris", "unit": "c"})]
    content, reasoning, calls = _stream(_harmony_plan(), HARMONY_CALL, step)
    assert (content, reasoning) == ("Checking.", "The user wants the weather.")
    assert [c["function"]["arguments"] for c in calls] == [c["function"]["arguments"] for c in message.tool_calls]


@pytest.mark.parametrize("step", [1, 5])
def test_harmony_final_channel_and_plain_text(step):
    plan = ChatOutputPlan(reasoning=get_reasoning_parser("openai_gptoss"))  # no tools: the reasoning parser alone
    message = ChoiceView(plan).message(HARMONY_FINAL)
    assert (message.reasoning_content, message.content) == ("Say hi.", "Hello <there>!")
    content, reasoning, _ = _stream(ChatOutputPlan(reasoning=get_reasoning_parser("openai_gptoss")), HARMONY_FINAL,
                                    step)
    assert (reasoning, content) == ("Say hi.", "Hello <there>!")
    assert ChoiceView(_harmony_plan()).message("no markup at all").content == "no markup at all"
    recipient_first = ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time<|channel|>'
                       'commentary json<|message|>{}<|call|>')
    assert _calls(ChoiceView(_harmony_plan()).message(recipient_first).tool_calls) == [("get_time", {})]
    assert _harmony_plan().needs_special_tokens and not _coder_plan().needs_special_tokens


def test_detection_from_chat_templates():
    coder = "{% for t in tools %}...{% endfor %}<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>"
    harmony = "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>"
    assert detect_tool_parser(coder) == "qwen3_coder" and detect_tool_parser(harmony) == "openai"
    assert detect_tool_parser('<tool_call>{"name": ...}</tool_call>') == "hermes"
    assert detect_reasoning_parser(harmony) == "openai_gptoss" and detect_reasoning_parser(coder) is None
    assert type(get_tool_parser("harmony")) is type(get_tool_parser("openai"))
