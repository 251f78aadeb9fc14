"""Embedding models (``spec.task: embedding``): a BERT-family encoder in MLX.

mlx-lm has no encoders, so the (small) BERT forward pass is written here
against the Hugging Face checkpoint layout, with sentence-transformers'
pooling and normalisation read from the model's own config files. All MLX work
runs on one dedicated thread, as in the generation engine.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import math
import time
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .generation import EngineState


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: str = "float"
    dimensions: Optional[int] = Field(default=None, ge=1)
    user: Optional[str] = None

    @field_validator("input")
    @classmethod
    def _nonempty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        if isinstance(v, list) and len(v) > 2048:
            raise ValueError("at most 2048 inputs per request")
        return v

    @field_validator("encoding_format")
    @classmethod
    def _fmt(cls, v):
        if v not in ("float", "base64"):
            raise ValueError("encoding_format must be 'float' or 'base64'")
        return v


class OllamaEmbedRequest(BaseModel):
    """Ollama's ``/api/embed``: ``truncate`` (default true) cuts inputs to the context."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: Union[str, list[str]]
    truncate: bool = True
    dimensions: Optional[int] = Field(default=None, ge=1)

    @field_validator("input")
    @classmethod
    def _nonempty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        return v


class OllamaEmbeddingsRequest(BaseModel):
    """Ollama's older ``/api/embeddings``: one ``prompt``, one ``embedding``."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    prompt: str = ""


def _bert(config: dict):
    import mlx.core as mx
    import mlx.nn as nn

    h, heads = config["hidden_size"], config["num_attention_heads"]
    eps = config.get("layer_norm_eps", 1e-12)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
            self.o, self.ln1 = nn.Linear(h, h), nn.LayerNorm(h, eps=eps)
            self.up = nn.Linear(h, config["intermediate_size"])
            self.down = nn.Linear(config["intermediate_size"], h)
            self.ln2 = nn.LayerNorm(h, eps=eps)

        def __call__(self, x, mask):
            b, n, _ = x.shape

            def split(t):
                return t.reshape(b, n, heads, h // heads).transpose(0, 2, 1, 3)

            a = mx.fast.scaled_dot_product_attention(
                split(self.q(x)), split(self.k(x)), split(self.v(x)),
                scale=1 / math.sqrt(h // heads), mask=mask)
            x = self.ln1(x + self.o(a.transpose(0, 2, 1, 3).reshape(b, n, h)))
            return self.ln2(x + self.down(nn.gelu(self.up(x))))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.word = nn.Embedding(config["vocab_size"], h)
            self.pos = nn.Embedding(config["max_position_embeddings"], h)
            self.type = nn.Embedding(config.get("type_vocab_size", 2), h)
            self.ln = nn.LayerNorm(h, eps=eps)
            self.layers = [Layer() for _ in range(config["num_hidden_layers"])]

        def __call__(self, ids, attn):
            n = ids.shape[1]
            x = self.word(ids) + self.pos(mx.arange(n))[None] + self.type(mx.zeros_like(ids))
            x = self.ln(x)
            mask = mx.where(attn[:, None, None, :] > 0, 0.0, -1e9).astype(x.dtype)
            for layer in self.layers:
                x = layer(x, mask)
            return x

    return Bert()


_RENAMES = [("embeddings.word_embeddings", "word"), ("embeddings.position_embeddings", "pos"),
            ("embeddings.token_type_embeddings", "type"), ("embeddings.LayerNorm", "ln"),
            ("encoder.layer.", "layers."), ("attention.self.query", "q"),
            ("attention.self.key", "k"), ("attention.self.value", "v"),
            ("attention.output.dense", "o"), ("attention.output.LayerNorm", "ln1"),
            ("intermediate.dense", "up"), ("output.dense", "down"), ("output.LayerNorm", "ln2")]


def _rename(key: str) -> Optional[str]:
    key = key.removeprefix("bert.")
    if key.startswith(("pooler.", "cls.")) or key.endswith("position_ids"):
        return None
    for a, b in _RENAMES:
        key = key.replace(a, b)
    return key.replace(".gamma", ".weight").replace(".beta", ".bias")


class EmbeddingEngine:
    """Loads an encoder on its own thread and embeds batches of token lists there."""

    def __init__(self, source: str, revision: Optional[str] = None):
        self.source, self.revision = source, revision
        self.state, self.error = EngineState.PENDING, None
        self.tokenizer: Any = None
        self.context_length: Optional[int] = None
        self.load_seconds: Optional[float] = None
        self.requests_total = 0
        self.tokens_total = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlx-embed")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.state = EngineState.LOADING
        self._pool.submit(self._load_safely)

    def _load_safely(self) -> None:
        try:
            self._load()
            self.state = EngineState.READY
        except Exception as e:  # noqa: BLE001 - reported through /health
            self.error = f"{type(e).__name__}: {e}"
            self.state = EngineState.FAILED

    def _load(self) -> None:
        import mlx.core as mx
        from mlx.utils import tree_unflatten
        from transformers import AutoTokenizer

        from ..sources import resolve_source

        t0 = time.monotonic()
        path = Path(resolve_source(self.source, self.revision))
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") not in ("bert", "roberta", "xlm-roberta"):
            raise ValueError(f"unsupported embedding architecture {config.get('model_type')!r}"
                             " (BERT-family encoders are supported)")
        self.model = _bert(config)
        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            for k, v in mx.load(str(f)).items():
                name = _rename(k)
                if name is not None:
                    weights[name] = v.astype(mx.float32)
        self.model.update(tree_unflatten(list(weights.items())))
        mx.eval(self.model.parameters())
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.context_length = min(config["max_position_embeddings"],
                                  getattr(self.tokenizer, "model_max_length", 10**9))
        pooling = path / "1_Pooling" / "config.json"
        p = json.loads(pooling.read_text()) if pooling.exists() else {}
        self.pool_mode = "cls" if p.get("pooling_mode_cls_token") else "mean"
        modules = path / "modules.json"
        self.normalize = not modules.exists() or "Normalize" in modules.read_text()
        self.load_seconds = time.monotonic() - t0

    def _embed(self, batch: list[list[int]]) -> list[list[float]]:
        import mlx.core as mx

        n = max(len(t) for t in batch)
        ids = mx.array([t + [0] * (n - len(t)) for t in batch])
        attn = mx.array([[1] * len(t) + [0] * (n - len(t)) for t in batch])
        x = self.model(ids, attn)
        if self.pool_mode == "cls":
            v = x[:, 0]
        else:
            m = attn[..., None].astype(x.dtype)
            v = (x * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1e-9)
        if self.normalize:
            v = v / mx.maximum(mx.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
        return v.tolist()

    async def embed(self, batch: list[list[int]]) -> list[list[float]]:
        self.requests_total += 1
        self.tokens_total += sum(map(len, batch))
        loop = asyncio.get_running_loop()
        out: list[list[float]] = []
        for i in range(0, len(batch), 64):  # bounded memory per forward pass
            out += await loop.run_in_executor(self._pool, self._embed, batch[i:i + 64])
        return out

    def stop(self, timeout: float = 10.0) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.state = EngineState.STOPPED


def encode_vector(v: list[float], fmt: str) -> Union[list[float], str]:
    if fmt == "base64":
        import numpy as np

        return base64.b64encode(np.asarray(v, dtype=np.float32).tobytes()).decode()
    return v


def create_embedding_app(engine: EmbeddingEngine, name: str):
    """The worker app for an embedding model: /v1/embeddings plus the common routes."""
    from quart import Quart, request

    from ..wire import APIError, parse_json_body, parse_model
    from .app import common_routes

    app = Quart("mlxfleet.embeddings")
    common_routes(app, name, "embedding", engine, lambda: {
        "requests_total": engine.requests_total, "prompt_tokens_total": engine.tokens_total})

    def ready() -> None:
        if engine.state != EngineState.READY:
            raise APIError(503, f"Model '{name}' is not available: "
                           f"{engine.error or engine.state}", type="service_unavailable",
                           code="model_unavailable", headers={"Retry-After": "1"})

    async def embed(inp: Any, truncate: bool = False) -> tuple[list[list[float]], int]:
        """Vectors for strings or token lists, and the tokens they took."""
        tok = engine.tokenizer
        if isinstance(inp, str):
            batch = [tok(inp)["input_ids"]]
        elif all(isinstance(x, str) for x in inp):
            batch = [tok(x)["input_ids"] for x in inp]
        elif all(isinstance(x, int) for x in inp):
            batch = [list(inp)]
        else:
            batch = [list(x) for x in inp]
        vocab = len(tok)
        for i, ids in enumerate(batch):
            if not ids:
                raise APIError(400, f"Input {i} is empty.", param="input", code="empty_input")
            if len(ids) > engine.context_length:
                if truncate:
                    batch[i] = ids = ids[:engine.context_length]
                else:
                    raise APIError(400, f"Input {i} has {len(ids)} tokens; this model's "
                                   f"maximum context length is {engine.context_length} "
                                   "tokens.", param="input", code="context_length_exceeded")
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"Input {i} has a token id outside the vocabulary.",
                               param="input", code="invalid_token")
        return await engine.embed(batch), sum(map(len, batch))

    @app.post("/v1/embeddings")
    async def embeddings():
        req = parse_model(EmbeddingRequest, parse_json_body(await request.get_data()))
        ready()
        if req.dimensions is not None:
            raise APIError(400, f"Model '{name}' does not support 'dimensions'.",
                           param="dimensions", code="unsupported_parameter")
        vectors, n = await embed(req.input)
        return {"object": "list", "model": name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": encode_vector(v, req.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.post("/api/embed")
    async def ollama_embed():
        t0 = time.monotonic()
        req = parse_model(OllamaEmbedRequest, parse_json_body(await request.get_data()))
        ready()
        if req.dimensions is not None:
            raise APIError(400, f"model '{name}' does not support dimensions",
                           param="dimensions", code="unsupported_parameter")
        vectors, n = await embed(req.input, truncate=req.truncate)
        return {"model": name, "embeddings": vectors,
                "total_duration": int((time.monotonic() - t0) * 1e9), "load_duration": 0,
                "prompt_eval_count": n}

    @app.post("/api/embeddings")
    async def ollama_embeddings():
        req = parse_model(OllamaEmbeddingsRequest, parse_json_body(await request.get_data()))
        ready()
        if not req.prompt:
            return {"embedding": []}
        vectors, _ = await embed(req.prompt, truncate=True)
        return {"embedding": vectors[0]}

    return app
