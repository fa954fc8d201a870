"""Image content hashes: what the encoder cache and the prefix cache key an image by.

The hash is over the decoded image (mode, size, pixel bytes), not the bytes that carried it: the same picture sent
as PNG and as a data URL of that PNG is one item, and two files that decode alike share one encoding.
"""
from __future__ import annotations

import hashlib


def hash_image(image) -> str:
    """sha256 hex of a PIL image's mode, size and pixels."""
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
