"""Constrained decoding with llguidance, as a per-sequence logits processor in the batch.

llguidance's own ``llguidance.mlx`` helper needs Metal, so we apply its token
bitmask ourselves with numpy + ``mx.where``; that works on CPU and Metal alike.
Everything here that touches MLX runs on the engine thread; compiling a
grammar (a pure-CPU step) is done when the request is validated, so a bad
schema is a 400 before anything is queued.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

_tokenizers: dict[int, Any] = {}
#: Cost of the constraint, for the worker's status (engine thread only).
STATS = {"mask_seconds": 0.0, "steps": 0}


def ll_tokenizer(tokenizer: Any, vocab_size: int):
    """llguidance's view of the tokenizer (built once per worker: ~1 s for large vocabs)."""
    key = id(tokenizer)
    if key not in _tokenizers:
        import llguidance.hf

        _tokenizers[key] = llguidance.hf.from_tokenizer(
            tokenizer._tokenizer, n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids))
    return _tokenizers[key]


class GrammarError(ValueError):
    pass


def json_schema_grammar(schema: dict[str, Any]) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(
        # At most one space after separators: what models learned from json.dumps, and
        # no room for a random-weight model to loop on whitespace forever.
        json.dumps(schema), defaults={"whitespace_flexible": False, "whitespace_pattern": " ?"})


def tool_call_schema(tools: list[dict[str, Any]], name: Optional[str] = None) -> dict[str, Any]:
    """A JSON schema for ``{"name": ..., "arguments": {...}}`` over the declared tools."""
    options = []
    for t in tools:
        fn = t.get("function", t)
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {
            "name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False})
    if not options:
        raise GrammarError(f"tool_choice names '{name}', which is not among the declared tools")
    return options[0] if len(options) == 1 else {"anyOf": options}


def check_grammar(grammar: str, tokenizer: Any, vocab_size: int) -> None:
    """Raise GrammarError if llguidance cannot compile ``grammar``."""
    import llguidance

    m = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size), grammar)
    if m.is_error():
        raise GrammarError(m.get_error())


class GrammarProcessor:
    """mlx_lm logits processor: masks every token the grammar does not allow next.

    ``tokens`` is the sequence so far (prompt, then each generated token as it is
    fed back); the first call sees only the prompt.
    """

    def __init__(self, grammar: str, tokenizer: Any, vocab_size: int):
        import llguidance

        self._m = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size), grammar)
        self._eos = sorted(tokenizer.eos_token_ids)
        self._base: Optional[int] = None
        self._consumed = 0

    def __call__(self, tokens, logits):
        import mlx.core as mx
        import numpy as np
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        t0 = time.perf_counter()
        n = tokens.shape[-1] if hasattr(tokens, "shape") else len(tokens)
        if self._base is None:
            self._base = n
        new = n - self._base - self._consumed
        if new > 0:
            for t in tokens[-new:].tolist():
                self._m.consume_token(int(t))
            self._consumed += new
        vocab = logits.shape[-1]
        bm = allocate_token_bitmask(1, vocab)
        fill_next_token_bitmask(self._m, bm)
        bits = np.unpackbits(bm.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        if not bits.any():  # grammar finished or failed: allow only end-of-sequence
            bits[[t for t in self._eos if t < vocab]] = True
        out = mx.where(mx.array(bits)[None, :], logits, -float("inf"))
        STATS["mask_seconds"] += time.perf_counter() - t0
        STATS["steps"] += 1
        return out
