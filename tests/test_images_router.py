"""Images through the router: a real router process with a Qwen3.5 VL model and a text model behind it; /v1/models
says which takes images before either loads, a chat image part reaches the VL engine and gets HF's greedy answer,
and the text model answers an image with a 400 naming the part."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_cli import free_port
from tiny_models import hf_model
from tiny_vl_models import hf_greedy_mm, make_tiny_vl_model, random_image

pytest.importorskip("PIL")
pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
TEXT, MAX_TOKENS = "Describe this.", 8


@pytest.fixture(scope="module")
def router(tmp_path_factory, tiny_model_dir):
    vl = make_tiny_vl_model(tmp_path_factory.mktemp("vl"), "qwen3_5-vl")
    port = free_port()
    argv = [sys.executable, "-m", "engine.entrypoints.serve", "--model", f"vl={vl}", "--model",
            f"text={tiny_model_dir('llama')}", "--device", "cpu", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 60
    while not any(line.startswith("PagedDesk serving") for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, f"the router did not start: {lines}"
        time.sleep(0.05)
    proc.url, proc.vl = f"http://127.0.0.1:{port}", vl
    yield proc
    proc.kill()
    proc.wait(30)


def image_chat(router, model: str) -> httpx.Response:
    import base64
    import io
    buffer = io.BytesIO()
    random_image(56, 84, 0).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return httpx.post(router.url + "/v1/chat/completions", timeout=240, json={
        "model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": TEXT}]}]})


def test_models_say_which_take_images(router):
    cards = {m["id"]: m for m in httpx.get(router.url + "/v1/models", timeout=30).json()["data"]}
    assert cards["vl"]["input_modalities"] == ["text", "image"]
    assert cards["text"]["input_modalities"] == ["text"]


def test_an_image_passes_through_to_the_vl_engine(router):
    from transformers import AutoTokenizer

    from engine.config.model import ModelConfig
    from engine.multimodal.processor import MultiModalProcessor
    reply = image_chat(router, "vl")
    assert reply.status_code == 200, reply.text
    tokenizer = AutoTokenizer.from_pretrained(router.vl)
    processor = MultiModalProcessor(router.vl, ModelConfig.from_folder(router.vl).vision, tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}],
                                         tokenize=False, add_generation_prompt=True)
    inputs = processor.process(text, [random_image(56, 84, 0)], add_special_tokens=False)
    assert reply.json()["choices"][0]["token_ids"] == hf_greedy_mm(hf_model(router.vl), inputs, MAX_TOKENS)


def test_a_text_model_answers_an_image_with_a_400(router):
    reply = image_chat(router, "text")
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith("messages.0.content.")
