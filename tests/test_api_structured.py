"""Structured outputs through the API with the openai SDK: a random-weight model's output always parses and
validates (greedy and sampled, n>1, streamed, both routes), specs compile once, bad specs are a 400."""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from server_harness import MODEL_NAME, start_server
from tiny_models import TOOL_CHAT_TEMPLATE

USER = [{"role": "user", "content": "Describe an item."}]


class Item(BaseModel):
    """Every JSON type, bounded so that a random model's output ends well inside max_tokens."""

    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=999)
    ok: bool
    kind: Literal["a", "bb", "ccc"]
    tags: list[Annotated[str, Field(max_length=4)]] = Field(max_length=3)
    note: str | None = Field(max_length=5)


SCHEMA = Item.model_json_schema()
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = start_server(tiny_model_dir("qwen2", chat_template=TOOL_CHAT_TEMPLATE))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("temperature, n", [(0.0, 1), (1.0, 3)])
def test_chat_json_schema_always_validates(client, temperature, n):
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, response_format=RESPONSE_FORMAT, n=n,
                                       temperature=temperature, max_tokens=150, seed=3)
    assert len(r.choices) == n
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        Item.model_validate_json(choice.message.content)


def test_streamed_n2_json_schema_validates(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=USER, response_format=RESPONSE_FORMAT, n=2,
                                            temperature=1.0, max_tokens=150, stream=True, seed=5)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        Item.model_validate_json(text)


def test_json_object_on_both_routes(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=USER, response_format={"type": "json_object"},
                                          temperature=1.0, max_tokens=60, seed=1, n=2)
    for choice in chat.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # an unbounded object may run out of tokens; what there is must be an object's prefix
            assert choice.message.content.startswith("{")
    comp = client.completions.create(model=MODEL_NAME, prompt="JSON:", max_tokens=150, temperature=0,
                                     extra_body={"response_format": RESPONSE_FORMAT})
    Item.model_validate_json(comp.choices[0].text)


def test_vllm_guided_fields(client):
    choices = ["yes", "no", "maybe so"]
    r = client.completions.create(model=MODEL_NAME, prompt=["a", "b", "c"], max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"guided_choice": choices})
    assert all(c.text in choices for c in r.choices)
    r = client.completions.create(model=MODEL_NAME, prompt="id:", max_tokens=20, temperature=1.0, n=3,
                                  extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text) for c in r.choices)
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=20, temperature=1.0,
                                       extra_body={"guided_grammar": 'root ::= "x" [0-9] [0-9]? "!"'})
    assert re.fullmatch(r"x[0-9]{1,2}!", r.choices[0].message.content)
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=150, temperature=0,
                                       extra_body={"structured_outputs": {"json": SCHEMA}})
    Item.model_validate_json(r.choices[0].message.content)
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=150, temperature=0,
                                       extra_body={"guided_json": SCHEMA})
    Item.model_validate_json(r.choices[0].message.content)


def test_structural_tags_in_every_form(client):
    """JSON only between the tags: xgrammar's format forces the tag; vLLM's structures/triggers form leaves free
    text until a trigger, so the random model's text is checked only where a tag opened."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    forced = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>",
                                                   "content": {"type": "json_schema", "json_schema": schema}}}
    for body in ({"response_format": forced}, {"structured_outputs": {"structural_tag": forced}},
                 {"structural_tag": json.dumps(forced)}):
        r = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=40, temperature=1.0,
                                           seed=3, extra_body=body)
        match = re.fullmatch(r"<f>(.*)</f>", r.choices[0].message.content, re.S)
        assert match and isinstance(json.loads(match.group(1))["a"], int), r.choices[0].message.content
    vllm_form = {"type": "structural_tag", "structures": [{"begin": "<f=get>", "schema": schema, "end": "</f>"}],
                 "triggers": ["<f="]}
    r = client.completions.create(model=MODEL_NAME, prompt="<f=get>", max_tokens=30, temperature=1.0, n=4, seed=1,
                                  extra_body={"response_format": vllm_form})
    for c in r.choices:
        for inside in re.findall(r"<f=get>(.*?)</f>", c.text, re.S):
            assert isinstance(json.loads(inside)["a"], int)


def test_schema_compiles_once(server, client):
    schema = {"type": "object", "properties": {"v": {"enum": ["p", "q"]}}, "required": ["v"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    grammars = server.async_engine.engine.grammars
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL_NAME, messages=USER, response_format=fmt, max_tokens=20)
        assert json.loads(r.choices[0].message.content)["v"] in ("p", "q")
    compiled = grammars.num_compiles
    client.chat.completions.create(model=MODEL_NAME, messages=USER, response_format=fmt, max_tokens=20)
    assert grammars.num_compiles == compiled


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"structured_outputs": {"json": SCHEMA, "unknown_option": 1}}, "structured_outputs.unknown_option"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "nonsense"}}'}, "structural_tag"),
])
def test_bad_spec_is_400_naming_it(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, extra_body=body)
    assert err.value.body["param"] == param, err.value.body
