"""Images from where requests point: `data:` URLs, `file://` paths and http(s) URLs, under the server's limits.

vLLM's rules: a local file is read only under `--allowed-local-media-path` (resolved, so `..` and links cannot leave
it); an http(s) URL only when `--allowed-media-domains` is unset or names its host, fetched with a byte cap and a
time limit; every image is decoded here, and refused before its pixels are decompressed when it has more than
`max_pixels` (a decompression bomb is a header, not a payload). Every refusal is a `MediaError` saying what was
wrong with the numbers; the server turns it into a 400 naming the request part.
"""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
DEFAULT_FETCH_TIMEOUT_S = 10.0


class MediaError(ValueError):
    """An image the request points at cannot be used: why, in words."""


@dataclass(frozen=True)
class MediaLimits:
    allowed_local_media_path: str | None = None  # file:// only under this folder; None: no local files
    allowed_media_domains: tuple[str, ...] | None = None  # http(s) hosts allowed; None: any host
    max_pixels: int | None = None  # width x height; None: the processor's own resizing is the only bound
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    @classmethod
    def from_config(cls, config) -> "MediaLimits":
        """The limits an EngineConfig's flags set (--allowed-local-media-path, --allowed-media-domains as a
        comma-separated list, --max-image-pixels)."""
        domains = config.allowed_media_domains
        if domains is not None:
            domains = tuple(d.strip().lower() for d in domains.split(",") if d.strip())
        return cls(config.allowed_local_media_path, domains, config.max_image_pixels)


def check_image_size(image, max_pixels: int | None, what: str = "image") -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise MediaError(f"{what} is {width}x{height} pixels: empty")
    if max_pixels is not None and width * height > max_pixels:
        raise MediaError(f"{what} is {width}x{height} = {width * height} pixels, more than the server's limit of "
                         f"{max_pixels} (--max-image-pixels); send a smaller image")


def decode_image(data: bytes, limits: MediaLimits, what: str = "image"):
    """A PIL image from encoded bytes, size-checked before its pixels are decompressed, then loaded."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise MediaError(f"{what} is {len(data)} bytes, more than the limit of {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
        check_image_size(image, limits.max_pixels, what)
        image.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"{what} cannot be decoded as an image: {exc}") from None
    return image


def load_image(url: str, limits: MediaLimits, what: str = "image"):
    """The image `url` points at: data:, file:// or http(s)://."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url, what), limits, what)
    if scheme == "file":
        return decode_image(_local_file_bytes(url, limits, what), limits, what)
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, limits, what), limits, what)
    raise MediaError(f"{what} URL must be a data:, file:// or http(s):// URL, got {url[:40]!r}")


def decode_base64_image(data: str, limits: MediaLimits, what: str = "image"):
    """An image sent as bare base64 (Anthropic's source type "base64")."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what} is not valid base64") from None
    return decode_image(raw, limits, what)


def _data_url_bytes(url: str, what: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"{what} data URL has no ',' before its data")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError(f"{what} data URL is not valid base64") from None
    return unquote(payload).encode("latin-1", errors="replace")


def _local_file_bytes(url: str, limits: MediaLimits, what: str) -> bytes:
    if limits.allowed_local_media_path is None:
        raise MediaError(f"{what}: file:// URLs are refused unless the server runs with --allowed-local-media-path")
    root = Path(limits.allowed_local_media_path).resolve()
    path = Path(unquote(urlparse(url).path)).resolve()
    if root != path and root not in path.parents:
        raise MediaError(f"{what}: {path} is outside --allowed-local-media-path ({root})")
    if not path.is_file():
        raise MediaError(f"{what}: no file at {path}")
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise MediaError(f"{what} is {size} bytes, more than the limit of {limits.max_bytes}")
    return path.read_bytes()


def _fetch(url: str, limits: MediaLimits, what: str) -> bytes:
    import httpx

    host = (urlparse(url).hostname or "").lower()
    if limits.allowed_media_domains is not None and host not in limits.allowed_media_domains:
        raise MediaError(f"{what}: host {host!r} is not in --allowed-media-domains "
                         f"({', '.join(limits.allowed_media_domains) or 'none'})")
    chunks, total = [], 0
    try:
        with httpx.stream("GET", url, timeout=limits.timeout_s, follow_redirects=False) as response:
            if response.status_code != 200:
                raise MediaError(f"{what}: {url} answered HTTP {response.status_code}")
            for chunk in response.iter_bytes():
                total += len(chunk)
                if total > limits.max_bytes:
                    raise MediaError(f"{what} at {url} is more than the limit of {limits.max_bytes} bytes")
                chunks.append(chunk)
    except httpx.TimeoutException:
        raise MediaError(f"{what}: {url} did not answer within {limits.timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise MediaError(f"{what}: {url} cannot be fetched: {exc}") from None
    return b"".join(chunks)
