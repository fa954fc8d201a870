"""Images attached to chat messages, kept as content-addressed files beside the chat's SQLite store.

A file is named by the SHA-256 of its bytes plus the extension of its type (`<store dir>/chat_images/<sha>.png`),
so the same picture attached twice is stored once and a message refers to it by that name alone. The bytes are
kept as attached (never re-encoded), so a regenerated reply sees exactly the image the first one saw; `data_url`
turns one into the `data:` URL a chat `image_url` part carries. Files are never deleted with a chat: a chat
brought back by Undo delete still finds them. No Qt here.
"""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path

MIME_BY_SUFFIX = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
                  ".webp": "image/webp", ".bmp": "image/bmp"}
SUFFIX_BY_MIME = {"image/png": ".png", "image/jpeg": ".jpg", "image/gif": ".gif", "image/webp": ".webp",
                  "image/bmp": ".bmp"}
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # a screenshot is a few MB; more is likely not an image one meant to send


class ImageTooLarge(ValueError):
    """An attachment over MAX_IMAGE_BYTES; phrased for the user."""


class ChatImages:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @classmethod
    def beside(cls, store_path: str | Path) -> "ChatImages":
        """The image folder of a chat store: `chat_images/` next to its SQLite file."""
        return cls(Path(store_path).parent / "chat_images")

    def put(self, data: bytes, mime: str) -> str:
        """Store `data` (bytes of an image of type `mime`) and return its name; storing it again is a no-op."""
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageTooLarge(f"The image is {len(data) / 2**20:.1f} MB; images up to "
                                f"{MAX_IMAGE_BYTES // 2**20} MB can be attached.")
        name = hashlib.sha256(data).hexdigest() + SUFFIX_BY_MIME.get(mime, ".png")
        path = self.directory / name
        if not path.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(path.suffix + ".part")  # a crash mid-write never leaves a short image
            partial.write_bytes(data)
            partial.replace(path)
        return name

    def put_file(self, path: str | Path) -> str:
        path = Path(path)
        mime = MIME_BY_SUFFIX.get(path.suffix.lower())
        if mime is None:
            raise ValueError(f"{path.name} is not an image this chat can send (PNG, JPEG, GIF, WebP or BMP).")
        return self.put(path.read_bytes(), mime)

    def path(self, name: str) -> Path:
        assert "/" not in name and "\\" not in name, name  # names come from put(), never from a path
        return self.directory / name

    def data_url(self, name: str) -> str:
        mime = MIME_BY_SUFFIX.get(Path(name).suffix, "image/png")
        return f"data:{mime};base64,{base64.b64encode(self.path(name).read_bytes()).decode('ascii')}"
