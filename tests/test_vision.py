"""Vision-language models: images through the OpenAI, Anthropic, Ollama and Responses APIs.

One fleet serves ``builtin:tiny-vlm`` (a LLaVA checkpoint with random weights, loaded by
mlx-vlm like one from the hub) and ``builtin:tiny`` (text only). Images are made in the
tests. The model's answers are gibberish; what is checked is what a user would see: the
image changes the prompt (usage counts its tokens), answers are deterministic at
temperature 0 (streamed or not, alone or batched with others), the prompt cache reuses an
image it has seen and not another, and every bad image is a 400 in the protocol's shape.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading

import anthropic
import httpx
import numpy as np
import ollama
import pytest
from served import Served, in_parallel, manifest

IMAGE_TOKENS = 16  # builtin:tiny-vlm: a 32x32 image in 8-pixel patches
QUESTION = ("Look at this picture carefully and describe what you see in it, the colors, "
            "the shapes, the light and anything else that stands out to you.")


def picture(seed: int, size=(70, 50)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def encoded(img, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(uri: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def images_server():
    """A local HTTP server with one image, for clients that send image URLs."""
    png = encoded(picture(7))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(png)
            else:
                self.send_response(404)
                self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", png
    srv.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("vision"), env={
        "MLXFLEET_ALLOW_IMAGE_URLS": "1", "MLXFLEET_MAX_IMAGE_PIXELS": "1000000",
        "MLXFLEET_MAX_REQUEST_PIXELS": "1500000"})
    f.write("vlm.yaml", manifest("vlm", source="builtin:tiny-vlm", aliases=["llava"],
                                 defaults={"temperature": 0, "maxTokens": 8}))
    f.write("tiny.yaml", manifest("tiny", source="builtin:tiny"))
    f.start()
    f.wait_ready("vlm")
    f.wait_ready("tiny")
    yield f
    f.stop()


def ask(served, messages, **kw):
    return served.openai().chat.completions.create(model="vlm", messages=messages,
                                                  max_tokens=8, temperature=0, **kw)


def test_openai_data_uri_streamed_or_not_and_image_tokens_counted(served):
    png = encoded(picture(1))
    r = ask(served, image_message(data_uri(png)))
    answer = r.choices[0].message.content
    assert answer and r.choices[0].finish_reason == "length"
    text_only = ask(served, [{"role": "user", "content": QUESTION}])
    # The image placeholder became the model's image tokens, and usage counts them.
    assert r.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS
    chunks = list(ask(served, image_message(data_uri(png)), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    # The same question about another image (a JPEG) is a different prompt.
    jpeg = encoded(picture(2), "JPEG")
    other = ask(served, image_message(data_uri(jpeg, "image/jpeg")))
    assert other.usage.prompt_tokens == r.usage.prompt_tokens


def test_text_only_requests_to_the_vision_model(served):
    r = ask(served, [{"role": "user", "content": "Hello there, what is the weather?"}])
    assert r.choices[0].message.content and r.usage.completion_tokens == 8
    c = served.openai().completions.create(model="llava", prompt="Once upon", max_tokens=4)
    assert c.usage.completion_tokens == 4


def test_anthropic_base64_block(served):
    client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    jpeg = encoded(picture(3), "JPEG")
    messages = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                     "data": base64.b64encode(jpeg).decode()}},
        {"type": "text", "text": QUESTION}]}]
    m = client.messages.create(model="vlm", max_tokens=8, messages=messages)
    assert m.content[0].text and m.stop_reason == "max_tokens"
    # The same image through OpenAI's API reads the same prompt and gives the same answer.
    o = ask(served, image_message(data_uri(jpeg, "image/jpeg")))
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert prompt == o.usage.prompt_tokens
    assert m.content[0].text == o.choices[0].message.content
    count = client.messages.count_tokens(model="vlm", messages=messages)
    assert count.input_tokens == prompt


def test_ollama_images(served):
    client = ollama.Client(host=served.url)
    png = encoded(picture(4))
    r = client.chat(model="vlm", messages=[{"role": "user", "content": QUESTION,
                                            "images": [png]}],
                    options={"temperature": 0, "num_predict": 8})
    assert r.message.content and r.prompt_eval_count > IMAGE_TOKENS
    g = client.generate(model="vlm", prompt=QUESTION, images=[png],
                        options={"temperature": 0, "num_predict": 8})
    assert g.response == r.message.content  # the same prompt, however it was sent
    assert "vision" in client.show("vlm").capabilities
    assert "vision" not in client.show("tiny").capabilities
    # The client checks base64 itself, so the bad one goes over plain HTTP.
    r = httpx.post(served.url + "/api/chat", timeout=30, json={
        "model": "vlm", "stream": False,
        "messages": [{"role": "user", "content": "hi", "images": ["not base64!"]}]})
    assert r.status_code == 400
    assert r.json()["error"] == "messages[0].images[0]: The image is not valid base64."


def test_responses_input_image(served):
    png = encoded(picture(5))
    r = served.openai().responses.create(model="vlm", max_output_tokens=8, temperature=0,
                                        input=[{"role": "user", "content": [
                                            {"type": "input_image",
                                             "image_url": data_uri(png)},
                                            {"type": "input_text", "text": QUESTION}]}])
    assert r.output_text == ask(served, image_message(data_uri(png))).choices[0].message.content


def test_image_url_fetched_when_allowed(served, images_server):
    base, png = images_server
    by_url = ask(served, image_message(f"{base}/cat.png"))
    inline = ask(served, image_message(data_uri(png)))
    assert by_url.choices[0].message.content == inline.choices[0].message.content
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30, json={
        "model": "vlm", "messages": image_message(f"{base}/missing.png")})
    assert r.status_code == 400 and "404" in r.json()["error"]["message"]


def _error(served, messages, path="/v1/chat/completions", **extra):
    r = httpx.post(served.url + path, timeout=30,
                   json={"model": "vlm", "max_tokens": 4, "messages": messages, **extra})
    return r.status_code, r.json()


@pytest.mark.parametrize("payload,mime,says", [
    (base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode(), "image/png", "not an image"),
    (base64.b64encode(b"just some text").decode(), "text/plain", "not an image"),
    ("%%%not-base64%%%", "image/png", "base64"),
])
def test_bad_images_are_400s_that_say_why(served, payload, mime, says):
    status, body = _error(served, image_message(f"data:{mime};base64,{payload}"))
    assert status == 400 and says in body["error"]["message"]
    assert body["error"]["param"] == "messages[0].content[0]"


def test_formats_pixels_truncation_and_several_images(served):
    status, body = _error(served, image_message(data_uri(encoded(picture(1), "BMP"))))
    assert status == 400 and "BMP" in body["error"]["message"]
    big = encoded(picture(1, size=(1200, 1000)), "PNG")  # 1.2 MP over a 1 MP limit
    status, body = _error(served, image_message(data_uri(big)))
    assert status == 400 and "pixels" in body["error"]["message"]
    cut = encoded(picture(1), "JPEG")[:200]
    status, body = _error(served, image_message(data_uri(cut, "image/jpeg")))
    assert status == 400 and "decoded" in body["error"]["message"]
    one = image_message(data_uri(encoded(picture(1))))
    two = image_message(data_uri(encoded(picture(1))))
    two[0]["content"].insert(0, {"type": "image_url",
                                 "image_url": {"url": data_uri(encoded(picture(9)))}})
    assert ask(served, two).usage.prompt_tokens == \
        ask(served, one).usage.prompt_tokens + IMAGE_TOKENS
    assert ask(served, [{"role": "user", "content": "still here?"}]).choices  # unharmed


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds no pixels: a few dozen bytes
    that say 'decompress me to gigabytes' (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_decompression_bombs_and_the_request_pixel_budget_are_400s(served):
    status, body = _error(served, image_message(data_uri(png_header_only(20000, 20000))))
    assert status == 400 and "pixels" in body["error"]["message"], body  # was a 500
    # each image under the per-image limit (1 MP), together over the request's (1.5 MP)
    big = data_uri(encoded(picture(3, size=(1000, 900)), "PNG"))
    two = image_message(big)
    two[0]["content"].insert(0, {"type": "image_url", "image_url": {"url": big}})
    status, body = _error(served, two)
    assert status == 400 and "in one request" in body["error"]["message"], body
    assert ask(served, image_message(big)).choices  # one of them alone is fine


def test_images_to_a_text_model_are_refused_in_each_protocol(served):
    uri = data_uri(encoded(picture(1)))
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": image_message(uri)})
    assert r.status_code == 400 and "not a vision model" in r.json()["error"]["message"]
    client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user",
                               "content": [{"type": "image", "source": {
                                   "type": "base64", "media_type": "image/png",
                                   "data": uri.split(",")[1]}}]}])
    assert e.value.body["type"] == "error"
    assert "not a vision model" in e.value.body["error"]["message"]


def test_prompt_cache_hits_the_same_image_and_misses_another(served):
    first = data_uri(encoded(picture(11)))
    other = data_uri(encoded(picture(12)))
    ask(served, image_message(first))
    again = ask(served, image_message(first))
    # The image comes first, so a hit covers it: everything but the last token.
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    miss = ask(served, image_message(other))
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    # A follow-up turn about the first image reuses the whole first exchange.
    follow = image_message(first) + [
        {"role": "assistant", "content": again.choices[0].message.content},
        {"role": "user", "content": "And what else?"}]
    r = ask(served, follow)
    assert r.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1


def test_concurrent_image_requests_share_the_batch_and_match_alone(served):
    uris = [data_uri(encoded(picture(20 + i))) for i in range(4)]
    questions = [f"Picture {i}: what is in it? " + QUESTION for i in range(4)]
    alone = [ask(served, image_message(u, q)).choices[0].message.content
             for u, q in zip(uris, questions)]
    text = ask(served, [{"role": "user", "content": "A text request in the same batch."}])
    calls = [(image_message(u, q),) for u, q in zip(uris, questions)] + [
        ([{"role": "user", "content": "A text request in the same batch."}],)]
    together = in_parallel(lambda m: ask(served, m).choices[0].message.content, calls)
    assert together == alone + [text.choices[0].message.content]


def test_image_urls_are_refused_unless_allowed(start_worker, images_server):
    base, _ = images_server
    w = start_worker(source="builtin:tiny-vlm", name="vlm")
    with w.client() as c:
        r = c.post("/v1/chat/completions", json={
            "model": "vlm", "messages": image_message(f"{base}/cat.png")})
    assert r.status_code == 400 and "does not fetch image URLs" in r.json()["error"]["message"]
