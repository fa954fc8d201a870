"""Issue 35, App: images in the chat window. A real server on 127.0.0.1 with a tiny random Qwen3.5 VL model: the
Attach button is on (its /v1/models entry lists image input), an attached image is sent and reaches the engine (the
reply's prompt holds the image's placeholder tokens, which the context meter counts); a tiny text model's entry
turns Attach off with a tooltip saying why. On the fake engine: pasted and dropped pictures are attached, stored
content-addressed beside the chat store, shown as thumbnails after a reopen, and sent again by Regenerate."""
import qt_helpers as helpers

import hashlib
import io
import json

import httpx
import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent, QImage

from app.chat_panel import ChatPanel
from app.chat_store import ChatStore
from app.loaded_models import ModelRow, model_rows
from app.supervisor import EngineSupervisor

pytest.importorskip("PIL")


def png(width=56, height=84, seed=0) -> bytes:
    from tiny_vl_models import random_image
    buffer = io.BytesIO()
    random_image(width, height, seed).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def panel(qtbot, tmp_path):
    p = ChatPanel(ChatStore(tmp_path / "chat.db"))
    qtbot.addWidget(p)
    yield p
    p.client.wait_idle()


def test_an_attached_image_reaches_a_vision_model_and_the_meter_counts_its_tokens(panel, qtbot, tmp_path):
    from server_harness import MODEL_NAME, start_server
    from tiny_vl_models import make_tiny_vl_model
    srv = start_server(make_tiny_vl_model(tmp_path / "vl", "qwen3_5-vl"))
    try:
        panel.set_endpoint(srv.url, None, MODEL_NAME)
        assert not panel.attach_button.isEnabled()  # not known yet to take images
        panel.set_models(model_rows(httpx.get(srv.url + "/v1/models", timeout=10).json()))
        assert panel.attach_button.isEnabled() and "Attach images" in panel.attach_button.toolTip()
        panel.attach_images([(png(), "image/png")])
        assert panel.attachments.isVisibleTo(panel) and "1 image attached" in panel.attachments.text()
        panel.max_tokens.setValue(4)
        panel.input.setPlainText("Describe this.")
        with qtbot.waitSignal(panel.reply_finished, timeout=120_000) as done:
            panel.send_button.click()
        result = done.args[0]
        processor = srv.async_engine.engine.mm_processor
        from tiny_vl_models import random_image
        messages = [{"role": "system", "content": panel.system_prompt.toPlainText()},
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this."}]}]
        text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        expected = processor.process(text, [random_image(56, 84, 0)], add_special_tokens=False)
        assert expected.items and result.usage["prompt_tokens"] == len(expected.prompt_token_ids)  # the image went in
        total = result.usage["total_tokens"]
        assert panel.context_meter.format() == f"Context {total:,} / {result.max_model_len:,} tokens"
        assert not panel.attached and not panel.attachments.isVisibleTo(panel)  # sent: the next message starts bare
        assert len(panel.view.messages[-2].images) == 1  # the thumbnail in the sent message
    finally:
        srv.stop()


def test_attach_is_off_for_a_text_model_and_says_why(panel, qtbot, tmp_path):
    from server_harness import MODEL_NAME, start_server
    from tiny_models import make_tiny_model
    srv = start_server(make_tiny_model(tmp_path / "text"))
    try:
        panel.set_endpoint(srv.url, None, MODEL_NAME)
        panel.set_models(model_rows(httpx.get(srv.url + "/v1/models", timeout=10).json()))
        assert not panel.attach_button.isEnabled()
        assert "takes text only" in panel.attach_button.toolTip() and MODEL_NAME in panel.attach_button.toolTip()
        panel.attach_images([(png(), "image/png")])  # a paste or drop is refused the same way, saying why
        assert panel.attached == [] and "takes text only" in panel.status.text()
    finally:
        srv.stop()
    panel.set_endpoint(None)
    assert not panel.attach_button.isEnabled() and "Start the engine" in panel.attach_button.toolTip()


def test_pasted_and_dropped_images_are_stored_shown_and_sent_again_on_regenerate(panel, qtbot, tmp_path, monkeypatch):
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_SERVE_REQUEST_LOG", str(log))
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port()})
        panel.set_endpoint(sup.base_url, None, "fake-model")
        panel.set_models([ModelRow("fake-model", "loaded", "CPU", 0, 4096, "none",
                                   input_modalities=("text", "image"))])
        pasted = QMimeData()
        pasted.setImageData(QImage.fromData(png(32, 32, 1)))
        panel.input.insertFromMimeData(pasted)  # Ctrl+V of a screenshot
        dropped_file = tmp_path / "photo.png"
        dropped_file.write_bytes(png())
        dropped = QMimeData()
        dropped.setUrls([QUrl.fromLocalFile(str(dropped_file))])
        panel.dropEvent(QDropEvent(QPointF(5, 5), Qt.DropAction.CopyAction, dropped, Qt.MouseButton.LeftButton,
                                   Qt.KeyboardModifier.NoModifier))
        assert len(panel.attached) == 2 and panel.input.toPlainText() == ""
        dropped_name = hashlib.sha256(png()).hexdigest() + ".png"  # the file's own bytes, named by their hash
        assert panel.attached[1] == dropped_name
        assert (tmp_path / "chat_images" / dropped_name).read_bytes() == png()
        panel.input.setPlainText("What is in these?")
        with qtbot.waitSignal(panel.reply_finished, timeout=10_000):
            panel.send_button.click()
        stored = panel.store.messages(panel.conversation_id)
        assert stored[0].role == "user" and not panel.attached
        assert len(stored[0].images) == 2 and stored[0].images[1] == dropped_name

        def image_urls(line):
            user = [m for m in json.loads(line)["messages"] if m["role"] == "user"][-1]
            return [p["image_url"]["url"] for p in user["content"] if p["type"] == "image_url"]
        first = image_urls(log.read_text().splitlines()[-1])
        assert len(first) == 2 and first[1].startswith("data:image/png;base64,")
        with qtbot.waitSignal(panel.reply_finished, timeout=10_000):
            panel.regenerate_button.click()
        assert image_urls(log.read_text().splitlines()[-1]) == first  # the same images again
        assert [m.role for m in panel.store.messages(panel.conversation_id)] == ["user", "assistant"]
    finally:
        sup.shutdown()
    reopened = ChatPanel(ChatStore(tmp_path / "chat.db"))  # the app started again: thumbnails from the files
    qtbot.addWidget(reopened)
    assert [m.images for m in reopened.view.messages][0] == tuple(
        str(tmp_path / "chat_images" / name) for name in stored[0].images)
    assert reopened.view.toHtml().count("<img") == 2
