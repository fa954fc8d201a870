"""Image parts of chat messages, in the shapes clients send them, split from the messages the template renders.

A message's content may be a list of parts; an image part (OpenAI's `image_url` with a URL, vLLM's offline
`image_pil` / `image` with a PIL image) becomes `{"type": "image"}` — the part every vision-language checkpoint's
chat template turns into its image placeholder — and its image reference (a URL string, or the image itself) is
collected in prompt order, for the processor that expands each placeholder (engine/multimodal/processor.py).
Messages without image parts are passed through unchanged.
"""
from __future__ import annotations

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def image_ref(part: dict):
    """A part's image: its URL string, or a PIL image; a ValueError for an image part without one."""
    kind = part.get("type")
    value = part.get(kind)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise ValueError("an image_url part needs image_url.url")
        return url
    if value is None:
        raise ValueError(f"an {kind!r} part needs its image under {kind!r}")
    return value


def split_image_parts(messages: list[dict]) -> tuple[list[dict], list]:
    """(messages with each image part as {"type": "image"}, the images' references in order)."""
    out, refs = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                                    for p in content):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                refs.append(image_ref(part))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, refs
