"""The chat's message box: plain text, plus pictures pasted or dropped into it, which it hands on as images.

`dropped_images` reads a clipboard or drag-and-drop payload into (bytes, MIME type) pairs: image files among its
URLs are read as they are (their own bytes, nothing re-encoded), a bare picture (a screenshot on the clipboard) is
encoded as PNG. `ChatInput` emits `images_given` with those pairs instead of inserting anything, and inserts text
as a plain text box does.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QMimeData, Signal
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QPlainTextEdit

from app.chat_images import MIME_BY_SUFFIX


def png_bytes(image: QImage) -> bytes:
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    return bytes(data.data())


def offers_images(mime: QMimeData) -> bool:
    """Whether a drag carries a picture or an image file (cheap: nothing is read)."""
    return mime.hasImage() or any(url.isLocalFile() and Path(url.toLocalFile()).suffix.lower() in MIME_BY_SUFFIX
                                  for url in mime.urls())


def dropped_images(mime: QMimeData) -> list[tuple[bytes, str]]:
    """The pictures in a paste or drop: image files by their URLs, else the bare image; [] when none."""
    files = [Path(url.toLocalFile()) for url in mime.urls() if url.isLocalFile()] if mime.hasUrls() else []
    images = [(path.read_bytes(), MIME_BY_SUFFIX[path.suffix.lower()]) for path in files
              if path.suffix.lower() in MIME_BY_SUFFIX and path.is_file()]
    if not images and mime.hasImage():
        image = QImage(mime.imageData())
        if not image.isNull():
            images.append((png_bytes(image), "image/png"))
    return images


class ChatInput(QPlainTextEdit):
    images_given = Signal(object)  # list[(bytes, mime)] pasted or dropped into the box

    def canInsertFromMimeData(self, source: QMimeData) -> bool:  # noqa: N802 - Qt's name
        return source.hasImage() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:  # noqa: N802 - Qt's name
        images = dropped_images(source)
        if images:
            self.images_given.emit(images)
        else:
            super().insertFromMimeData(source)
