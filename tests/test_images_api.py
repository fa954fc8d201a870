"""Images through the HTTP APIs of a Qwen3.5 VL engine: the real openai and anthropic SDKs send them (chat
`image_url` parts, Anthropic image blocks, Responses `input_image`) and get HF's greedy answer; data:, file:// (only
under --allowed-local-media-path) and http(s) URLs (only for --allowed-media-domains, fetched from a local HTTP
server); an undecodable, oversized or surplus image is a 400 naming its part, and the engine keeps serving."""
from __future__ import annotations

import base64
import http.server
import io
import threading

import httpx
import pytest

from server_harness import MODEL_NAME, start_server
from tiny_models import hf_model
from tiny_vl_models import hf_greedy_mm, make_tiny_vl_model, random_image

pytest.importorskip("PIL")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
MAX_TOKENS = 8
TEXT = "Describe this."


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


@pytest.fixture(scope="module")
def media_host():
    """A local HTTP server on 127.0.0.1 serving /cat.png."""
    body = png(random_image(56, 84, 0))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    random_image(56, 84, 0).save(folder / "cat.png")
    path = make_tiny_vl_model(tmp_path_factory.mktemp("vl"), "qwen3_5-vl")
    srv = start_server(path, allowed_local_media_path=str(folder), allowed_media_domains="127.0.0.1",
                       max_image_pixels=500 * 500, limit_mm_per_prompt='{"image": 2}')
    hf = hf_model(path)
    processor = srv.async_engine.engine.mm_processor
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}], tokenize=False,
        add_generation_prompt=True)
    expected = hf_greedy_mm(hf, processor.process(text, [random_image(56, 84, 0)], add_special_tokens=False), MAX_TOKENS)
    yield srv, folder, expected
    srv.stop()


def chat(srv, *parts, **extra):
    content = list(parts) + [{"type": "text", "text": TEXT}]
    return httpx.post(srv.base_url + "/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
        "messages": [{"role": "user", "content": content}], **extra})


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_openai_sdk_sends_an_image(vl_server):
    srv, _, expected = vl_server
    client = openai.OpenAI(base_url=srv.base_url, api_key="none")
    reply = client.chat.completions.create(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True}, messages=[
        {"role": "user", "content": [image_part(data_url(random_image(56, 84, 0))), {"type": "text", "text": TEXT}]}])
    assert reply.choices[0].token_ids == expected
    models = httpx.get(srv.base_url + "/models").json()["data"]
    assert models[0]["input_modalities"] == ["text", "image"]


def test_anthropic_sdk_and_responses_send_images(vl_server):
    srv, _, expected = vl_server
    want = chat(srv, image_part(data_url(random_image(56, 84, 0)))).json()["choices"][0]["message"]["content"]
    client = anthropic.Anthropic(base_url=srv.url, api_key="none")
    encoded = base64.b64encode(png(random_image(56, 84, 0))).decode()
    message = client.messages.create(model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                    "data": encoded}},
                                     {"type": "text", "text": TEXT}]}])
    assert message.content[0].text == want
    oai = openai.OpenAI(base_url=srv.base_url, api_key="none")
    response = oai.responses.create(model=MODEL_NAME, max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(random_image(56, 84, 0))},
                                     {"type": "input_text", "text": TEXT}]}])
    assert response.output_text == want


def test_local_files_and_http_urls_under_the_flags(vl_server, media_host):
    srv, folder, expected = vl_server
    assert chat(srv, image_part(f"file://{folder}/cat.png")).json()["choices"][0]["token_ids"] == expected
    assert chat(srv, image_part(f"http://127.0.0.1:{media_host}/cat.png")).json()["choices"][0]["token_ids"] == expected
    outside = chat(srv, image_part(f"file://{folder}/../cat.png"))
    assert outside.status_code == 400 and "outside --allowed-local-media-path" in outside.json()["error"]["message"]
    other_host = chat(srv, image_part(f"http://localhost:{media_host}/cat.png"))
    assert other_host.status_code == 400 and "--allowed-media-domains" in other_host.json()["error"]["message"]
    missing = chat(srv, image_part(f"http://127.0.0.1:{media_host}/none.png"))
    assert missing.status_code == 400 and "HTTP 404" in missing.json()["error"]["message"]


@pytest.mark.parametrize("parts,words", [
    ([image_part("data:image/png;base64,iVBORw0KGgo=")], "cannot be decoded as an image"),
    ([image_part("data:image/png;base64,@@@")], "not valid base64"),
    ([image_part(data_url(random_image(600, 600)))], "more than the server's limit of 250000"),
    ([image_part(data_url(random_image(56, 56)))] * 3, "more than this server takes per prompt"),
    ([image_part("ftp://example.invalid/x.png")], "data:, file:// or http(s)://"),
])
def test_bad_images_are_a_400_naming_the_part(vl_server, parts, words):
    srv, _, expected = vl_server
    reply = chat(srv, *parts)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and error["param"].startswith("messages.0.content.")
    assert chat(srv, image_part(data_url(random_image(56, 84, 0)))).json()["choices"][0]["token_ids"] == expected
