"""Chat for the families served as text: the checkpoint's own template decides (Gemma's folds a system message
into the first user turn and raises on roles that do not alternate: a 400 with its words), and image, audio or
video content is a 400 naming the part."""
from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from engine.entrypoints.openai.errors import OpenAIError
from engine.entrypoints.openai.prompts import chat_prompt
from engine.entrypoints.openai.protocol import ChatMessage
from engine.entrypoints.openai.served_model import ServedModel, plain_text_tokenizer, special_texts

# The shape of Gemma 3's template: no system turn (it becomes the first user turn's prefix), "model" for the
# assistant, and an exception when the roles do not alternate.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")


@pytest.fixture(scope="module")
def gemma_served(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("gemma3-vl"))
    tok.chat_template = GEMMA_TEMPLATE
    return ServedModel(name="g", root="g", tokenizer=tok, max_model_len=512, vocab_size=len(tok),
                       supports_tools=False, created=int(time.time()), text_tokenizer=plain_text_tokenizer(tok),
                       special_token_texts=special_texts(tok))


def chat(model, *messages):
    return chat_prompt(model, [ChatMessage(**m) for m in messages], None)


def test_system_message_follows_the_template(gemma_served):
    prompt = chat(gemma_served, {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    assert prompt.text == "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert "system" not in prompt.text


def test_a_raising_template_is_a_400_with_its_words(gemma_served):
    with pytest.raises(OpenAIError) as err:
        chat(gemma_served, {"role": "user", "content": "a"}, {"role": "user", "content": "b"})
    assert err.value.status == 400
    assert "Conversation roles must alternate user/assistant" in str(err.value.message)


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}}])
def test_media_content_is_a_400_naming_the_part(gemma_served, part):
    with pytest.raises(OpenAIError) as err:
        chat(gemma_served, {"role": "user", "content": [{"type": "text", "text": "what is this"}, part]})
    assert err.value.status == 400 and err.value.param == "messages.0.content.1"
    assert f"messages[0].content[1] is a {part['type']!r} part" in err.value.message
