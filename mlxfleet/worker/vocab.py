"""Token ids the model has rows for but the tokenizer does not: never sampled.

Real checkpoints pad their embedding matrix past the tokenizer (Gemma 3: 262208 rows
for 262145 ids; Qwen: 151936 for 151665). Random or fine-tuned weights can give those
rows the highest logit; mlx-lm's streaming detokenizer then raises ``IndexError``, and
fed back as input, an id past Gemma 4's per-layer embedding table reads out of range
(MLX's CPU gather does not check bounds). So the model's logits get -inf at every id
the tokenizer lacks, once, where the model returns them: every path that reads logits
(the batch's step, a lone request's first token, speculation's verifying pass, the
draft model, grammars, logprobs) sees only real tokens. Engine thread only.
"""

from __future__ import annotations

from typing import Any, Optional


def unknown_ids(vocab: dict[str, int], rows: int) -> frozenset[int]:
    """The ids below ``rows`` (the model's logits) that the tokenizer's ``vocab`` (its
    ``get_vocab()``) has no token for."""
    known = {i for i in vocab.values() if 0 <= i < rows}
    return frozenset(range(rows)) - known if len(known) < rows else frozenset()


def additive_mask(rows: int, unknown: frozenset[int]) -> Optional[Any]:
    """0 for the ids the tokenizer has, -inf for ``unknown`` (None: none unknown)."""
    import mlx.core as mx
    import numpy as np

    if not unknown:
        return None
    mask = np.zeros(rows, dtype=np.float32)
    mask[sorted(unknown)] = -np.inf
    return mx.array(mask)


def mask_unknown_ids(model: Any, mask: Any) -> Any:
    """``model`` whose outputs carry ``mask``: its class becomes a subclass whose
    ``__call__`` adds it (Python finds ``__call__`` on the class, and the mask stays out of
    the module's parameters, which quantizing, sharding and counting bytes walk)."""
    import mlx.core as mx

    base = type(model)

    def __call__(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        if isinstance(out, mx.array) and out.shape[-1] == mask.shape[0]:
            return out + mask.astype(out.dtype)
        return out

    model.__class__ = type(base.__name__, (base,), {"__call__": __call__,
                                                   "__module__": base.__module__})
    return model
