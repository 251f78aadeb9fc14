"""Images in requests: what the protocols hand over, and how they become model inputs.

The protocols turn their image parts (OpenAI ``image_url``, Anthropic ``image``
blocks, Ollama ``images``, Responses ``input_image``) into ``ImageRef``s and an
``{"type": "image"}`` part where the image sits in the message. Here they are fetched
(URLs only where the server allows them), checked (bytes, pixels, format), decoded
with Pillow, and run through the model's processor, which resizes them to its own
input size and expands each image placeholder to the model's image tokens.

Nothing here runs on the engine thread: the processor's arrays are converted to NumPy
in the thread that made them, and the engine turns them into MLX arrays (MLX arrays
must not cross threads).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field
from typing import Any, Optional

from ..wire import APIError
from ..worker_settings import WorkerConfig

#: Formats accepted (what Pillow reports); GIFs give their first frame.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp",
           "GIF": "image/gif"}


@dataclass
class ImageRef:
    """One image as the client sent it: bytes, or a URL to fetch; ``param`` names the
    field for errors (``messages[0].content[1]``)."""

    param: str
    data: Optional[bytes] = None
    url: Optional[str] = None
    media_type: Optional[str] = None  # what the client declared, if anything


@dataclass
class VisionPrompt:
    """A prompt with images, ready for the engine: token ids, the processor's other
    outputs as NumPy arrays, where the image tokens are, and the prompt-cache key
    (the ids with each image's tokens replaced by a value derived from its hash)."""

    ids: list[int]
    features: dict[str, Any]
    first: int  # index of the first image token
    last: int  # one past the last image token
    key: list[int] = field(default_factory=list)


def bad_image(param: str, message: str) -> APIError:
    """A 400 naming the image (``messages[0].content[1]: ...``): several may be sent, and
    some protocols' error shapes have no field for the parameter."""
    return APIError(400, f"{param}: {message}", param=param, code="invalid_image")


def from_data_uri(uri: str, param: str) -> ImageRef:
    """``data:image/png;base64,...`` -> bytes; anything else that is not http(s) is a 400."""
    if uri.startswith("data:"):
        head, _, payload = uri.partition(",")
        if ";base64" not in head:
            raise bad_image(param, "Image data URIs must be base64-encoded "
                            "(data:image/png;base64,...).")
        return ImageRef(param, data=from_base64(payload, param),
                        media_type=head[5:].split(";")[0] or None)
    if uri.startswith(("http://", "https://")):
        return ImageRef(param, url=uri)
    raise bad_image(param, "An image must be a data URI (data:image/png;base64,...) or an "
                    "http(s) URL.")


def openai_image(part: dict[str, Any], param: str) -> ImageRef:
    """An OpenAI ``image_url`` part (``{"url": ...}``) or a Responses ``input_image``
    (``image_url`` as a string)."""
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        if part.get("file_id"):
            raise bad_image(param, "Images by file_id are not supported; send the image "
                            "as a data URI.")
        raise bad_image(param, "An image part needs image_url (a data URI or an http(s) "
                        "URL).")
    return from_data_uri(url, param)


def anthropic_image(block: dict[str, Any], param: str) -> ImageRef:
    """An Anthropic ``image`` block: ``source`` of type ``base64`` or ``url``."""
    src = block.get("source") or {}
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64" and isinstance(src.get("data"), str):
        return ImageRef(param, data=from_base64(src["data"], param),
                        media_type=src.get("media_type"))
    if kind == "url" and isinstance(src.get("url"), str):
        if not src["url"].startswith(("http://", "https://")):
            raise bad_image(param, "An image url must be http(s).")
        return ImageRef(param, url=src["url"])
    raise bad_image(param, "An image block needs a source of type 'base64' (with "
                    "media_type and data) or 'url'.")


def from_base64(payload: str, param: str) -> bytes:
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise bad_image(param, "The image is not valid base64.") from None


async def fetch(ref: ImageRef, limits: WorkerConfig) -> bytes:
    """Download an image URL, within the size and time limits. URLs are off unless the
    server allows them: the server would fetch whatever address a client names (SSRF)."""
    import httpx

    if not limits.allow_image_urls:
        raise bad_image(ref.param, "This server does not fetch image URLs; send the image "
                        "inline (a base64 data URI), or start the server with image URLs "
                        "allowed (MLXFLEET_ALLOW_IMAGE_URLS=1).")
    try:
        async with httpx.AsyncClient(timeout=limits.image_fetch_timeout,
                                     follow_redirects=True) as client:
            async with client.stream("GET", ref.url) as r:
                if r.status_code != 200:
                    raise bad_image(ref.param, f"Fetching the image failed: HTTP "
                                    f"{r.status_code} from {ref.url}.")
                buf = bytearray()
                async for chunk in r.aiter_bytes():
                    buf += chunk
                    if len(buf) > limits.max_image_bytes:
                        raise bad_image(ref.param, f"The image at {ref.url} is larger "
                                        f"than {limits.max_image_bytes} bytes.")
                return bytes(buf)
    except httpx.HTTPError as e:
        raise bad_image(ref.param, f"Fetching the image failed: {type(e).__name__}: "
                        f"{e}") from None


def open_image(ref: ImageRef, data: bytes, limits: WorkerConfig):
    """Bytes -> a Pillow image whose header is read and checked (size, format, pixels),
    not yet decoded; or a 400 that says what is wrong with them."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise bad_image(ref.param, f"The image is {len(data)} bytes; this server accepts "
                        f"at most {limits.max_image_bytes}.")
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise bad_image(ref.param, "This is not an image (PNG, JPEG, WebP or GIF "
                        "expected).") from None
    except Image.DecompressionBombError as e:  # Pillow's own limit, past ours
        raise bad_image(ref.param, f"The image is too large to decode: {e}") from None
    except (OSError, ValueError, SyntaxError) as e:  # a known format, cut or corrupt
        raise bad_image(ref.param, f"The image could not be decoded: {e}") from None
    if img.format not in FORMATS:
        raise bad_image(ref.param, f"Image format {img.format} is not supported; send "
                        "PNG, JPEG, WebP or GIF.")
    w, h = img.size
    if w * h > limits.max_image_pixels:
        raise bad_image(ref.param, f"The image is {w}x{h} pixels; this server accepts at "
                        f"most {limits.max_image_pixels} pixels.")
    return img


def decode(ref: ImageRef, img: Any):
    """A checked image -> RGB pixels (the first frame of an animation)."""
    from PIL import Image

    try:
        img.seek(0)
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise bad_image(ref.param, f"The image could not be decoded: {e}") from None


async def load(refs: list[ImageRef], limits: WorkerConfig) -> list[tuple[Any, str]]:
    """Each image decoded, with the SHA-256 of its bytes (the prompt cache's key). Every
    header is checked before any image is decoded: each against the per-image limits,
    all together against the request's pixel budget."""
    import asyncio

    if len(refs) > limits.max_images:
        raise bad_image(refs[limits.max_images].param, f"This request has {len(refs)} "
                        f"images; this server accepts at most {limits.max_images}.")
    datas = [r.data if r.data is not None else await fetch(r, limits) for r in refs]

    def work():
        opened = [open_image(r, d, limits) for r, d in zip(refs, datas)]
        total = sum(img.size[0] * img.size[1] for img in opened)
        if total > limits.max_request_pixels:
            raise bad_image(refs[0].param, f"The request's {len(refs)} images have "
                            f"{total} pixels together; this server accepts at most "
                            f"{limits.max_request_pixels} in one request.")
        return [(decode(r, img), hashlib.sha256(d).hexdigest())
                for r, img, d in zip(refs, opened, datas)]

    return await asyncio.to_thread(work)  # decoding a large JPEG takes milliseconds


def trim_heap() -> None:
    """Give freed heap memory back to the system. glibc keeps it for reuse: a worker
    that decoded eight large images stayed at 2.4 GB after the request. (macOS's
    allocator returns large blocks by itself.)"""
    import sys

    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl)
            pass


def vision_prompt(processor: Any, text: str, images: list[tuple[Any, str]],
                  image_token: int, bos: Optional[int]) -> VisionPrompt:
    """Run the model's processor on the rendered prompt and images (in a worker thread).

    The processor may return MLX arrays; they are converted to NumPy here, in the thread
    that made them."""
    import numpy as np

    out = processor(text=text, images=[img for img, _ in images])
    ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1)]
    if bos is not None and ids[:2] == [bos, bos]:
        ids = ids[1:]  # the template wrote BOS and the tokenizer added another
    features = {k: np.asarray(v) for k, v in out.items()
                if k not in ("input_ids", "attention_mask") and v is not None}
    spans = _spans(ids, image_token)
    if not spans:
        raise APIError(400, "The model's chat template did not place the images in the "
                       "prompt.", param="messages", code="invalid_messages")
    return VisionPrompt(ids, features, spans[0][0], spans[-1][1],
                        cache_key(ids, spans, [h for _, h in images]))


def _spans(ids: list[int], token: int) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == token:
            if spans and spans[-1][1] == i:
                spans[-1] = (spans[-1][0], i + 1)
            else:
                spans.append((i, i + 1))
    return spans


def cache_key(ids: list[int], spans: list[tuple[int, int]], hashes: list[str]) -> list[int]:
    """The ids with image tokens replaced by negative values from the images' hashes, so
    that a prompt-cache match covers an image only when it is the same image. With one
    run of image tokens per image, each run takes its own image's hash (a follow-up turn
    that adds an image still reuses the earlier ones); otherwise every run takes the hash
    of all the images together."""
    def value(h: str) -> int:
        return -1 - int(h[:12], 16)

    per_span = hashes if len(spans) == len(hashes) else \
        [hashlib.sha256("".join(hashes).encode()).hexdigest()] * len(spans)
    key = list(ids)
    for (a, b), h in zip(spans, per_span):
        key[a:b] = [value(h)] * (b - a)
    return key
