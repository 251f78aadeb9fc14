"""KV cache quantization (``spec.cache.kvBits``, ``--kv-bits``) through real workers: the
answer is mlx-lm's with its quantized cache, and the same KV budget runs more sequences
at once. (Exactness on every family and the disk tier: tests/test_zoo.py.)"""

from __future__ import annotations

import json
import threading
import time

import mlx.core as mx
import openai
import pytest
from served import in_parallel

from mlxfleet.manifest import parse_text


def most_running(w, work) -> int:
    """Run ``work()``; the most sequences the worker ran together meanwhile."""
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], w.status()["num_running"])
            time.sleep(0.02)

    t = threading.Thread(target=watch)
    t.start()
    try:
        work()
    finally:
        done.set()
        t.join()
    return peak[0]


def test_a_quantized_kv_cache_answers_as_mlx_lm_and_fits_more_sequences(start_worker,
                                                                        tmp_path):
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxfleet.builtin import ensure_builtin

    budget = ("--cache-mb", "2", "--max-concurrency", "8")
    full = start_worker(*budget, source="builtin:tiny-10m")
    disk = json.dumps({"source": "builtin:tiny-10m", "disk_cache_bytes": 1 << 30,
                       "disk_cache_dir": str(tmp_path)})
    quantized = start_worker(*budget, "--kv-bits", "4", "--config", disk,
                             source="builtin:tiny-10m")
    paths = quantized.status()["paths"]
    assert paths["kv_cache"] == "quantized to 4 bits (groups of 64)"
    assert full.status()["paths"]["kv_cache"] == "full precision"
    assert paths["kv"]["bytes_per_token"] * 6 < full.status()["paths"]["kv"]["bytes_per_token"]

    ask = [{"role": "user", "content": "Tell me a story about a river. " * 6}]
    client = openai.OpenAI(base_url=quantized.base_url + "/v1", api_key="unused")
    r = client.chat.completions.create(model="tiny", messages=ask, max_tokens=20,
                                       temperature=0, extra_body={"ignore_eos": True,
                                                                  "return_token_ids": True})
    model, tok = load(str(ensure_builtin("tiny-10m")))
    prompt = tok.apply_chat_template(ask, add_generation_prompt=True)
    cache = [QuantizedKVCache(64, 4) for _ in model.layers]
    steps = generate_step(mx.array(prompt), model, max_tokens=20, prompt_cache=cache,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    expected = [int(t) for t, _ in steps]
    assert r.choices[0].token_ids == expected

    def eight(w):
        c = openai.OpenAI(base_url=w.base_url + "/v1", api_key="unused", max_retries=0)
        in_parallel(lambda i: c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Story {i}."}],
            max_tokens=100, extra_body={"ignore_eos": True}), [(i,) for i in range(8)])

    # 2 MB of KV: about two such sequences at full precision, all eight at 4 bits
    assert most_running(full, lambda: eight(full)) <= 3
    assert most_running(quantized, lambda: eight(quantized)) >= 6

    # The disk tier gives the next worker the quantized prompt cache back.
    quantized.stop()
    again = start_worker(*budget, "--kv-bits", "4", "--config", disk,
                         source="builtin:tiny-10m")
    client = openai.OpenAI(base_url=again.base_url + "/v1", api_key="unused")
    r = client.chat.completions.create(model="tiny", messages=ask, max_tokens=20,
                                       temperature=0, extra_body={"ignore_eos": True,
                                                                  "return_token_ids": True})
    assert r.choices[0].token_ids == expected
    assert r.usage.prompt_tokens_details.cached_tokens >= 32


@pytest.mark.parametrize("bits, ok", [(4, True), (8, True), (5, False), ("4", False)])
def test_the_manifest_takes_4_or_8_bits(bits, ok):
    text = ("apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: m}\n"
            f"spec: {{source: 'builtin:tiny', cache: {{kvBits: {bits!r}}}}}\n")
    r = parse_text(text, "m.yaml")
    if ok:
        assert not r.errors and r.models[0].manifest.spec.cache.kv_bits == bits
    else:
        assert not r.models and "kvBits" in str(r.errors[0]), r.errors
