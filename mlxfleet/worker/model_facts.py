"""Facts read off a loaded model and the MLX runtime (engine thread only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class KVCost:
    """What one sequence's cache costs as it grows, measured on the loaded model."""

    per_token: int  # bytes each token adds to the layers that keep every token
    windows: tuple[tuple[int, int], ...] = ()  # (bytes per token, window): sliding layers
    fixed: int = 0  # recurrent state (SSM, convolution): the same at any length

    def __add__(self, other: KVCost) -> KVCost:
        """Two caches one sequence keeps (a model's and its draft model's)."""
        return KVCost(self.per_token + other.per_token, self.windows + other.windows,
                      self.fixed + other.fixed)

    def as_dict(self) -> dict[str, Any]:
        return {"bytes_per_token": self.per_token, "fixed_bytes": self.fixed,
                "sliding_windows": [{"bytes_per_token": b, "tokens": w}
                                    for b, w in self.windows]}


def kv_cost(model: Any) -> KVCost:
    """Run one token and read what each layer's cache holds: per token for caches that
    keep keys and values (full heads, or the latent of MLA: whatever the architecture
    stores), bounded by the window for sliding ones, constant state for the others
    (SSM, convolution, linear attention)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import RotatingKVCache

    try:
        top, layers = make_prompt_caches(model)
        model(mx.array([[0]]), cache=top)
        mx.eval([c.state for c in top])
        per_token, windows, fixed = 0, [], 0
        for c in layers:
            kv = [a for x in (getattr(c, "keys", None), getattr(c, "values", None))
                  for _, a in tree_flatten(x) if hasattr(a, "nbytes")]
            if kv:  # buffers laid out (..., tokens, dim): bytes per token slot
                per = sum(a.nbytes // a.shape[-2] for a in kv)
                if isinstance(c, RotatingKVCache):
                    windows.append((per, int(c.max_size)))
                else:
                    per_token += per
            else:
                fixed += sum(a.nbytes for _, a in tree_flatten(c.state) if hasattr(a, "nbytes"))
        return KVCost(per_token, tuple(windows), fixed)
    except Exception:  # noqa: BLE001 - a model that cannot run a token here: estimate
        return KVCost(kv_bytes_per_token(model))


def make_prompt_caches(model: Any) -> tuple[list[Any], list[Any]]:
    """A fresh prompt cache (as the model takes it) and its layers' caches (``CacheList``
    opened up)."""
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    top = make_prompt_cache(model)
    layers = []
    for c in top:
        layers += list(c.caches) if isinstance(c, CacheList) else [c]
    return top, layers


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of K and V one token adds across all layers, from the model's arguments
    (0 if the shape is unknown): the estimate when ``kv_cost`` cannot run the model."""
    try:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        caches = make_prompt_cache(model)
        args = getattr(model, "args", None)
        kv_heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        dtype = next(iter(v for _, v in _leaves(model.parameters()))).dtype
        size = 4 if dtype == mx.float32 else 2  # quantized weights run in half precision
        return 2 * len(caches) * kv_heads * head_dim * size
    except Exception:  # noqa: BLE001 - unusual architectures: budget the cache only
        return 0


#: Architectures with recurrent state whose batched prefill (prompts of different lengths,
#: right-padded by mlx-lm) gives each prompt the tokens it gets alone: checked on the zoo
#: (tests/test_zoo.py). Any other recurrent model prefills one prompt at a time, because
#: padding runs through its state (mlx-lm 0.32's Nemotron-H / Mamba-2 mixer does).
PADDED_PREFILL_EXACT = frozenset({"qwen3_next", "lfm2"})


def _layer_caches(model: Any) -> list[Any]:
    return make_prompt_caches(model)[1]


def cache_kinds(model: Any) -> list[str]:
    """The class names of a fresh prompt cache's layers (``CacheList`` opened up)."""
    return sorted({type(c).__name__ for c in _layer_caches(model)})


def recurrent(model: Any) -> bool:
    """True when some layer keeps a state that is not per token (SSM, convolution,
    linear attention): such a cache cannot be cut back to an earlier prefix."""
    from mlx_lm.models.cache import ArraysCache

    return any(isinstance(c, ArraysCache) for c in _layer_caches(model))


def prefill_alone(model: Any, model_type: Optional[str]) -> bool:
    """Whether this model's prompts must be prefilled one at a time to be exact."""
    return recurrent(model) and model_type not in PADDED_PREFILL_EXACT


def _leaves(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def context_length(config: dict, tokenizer: Any) -> Optional[int]:
    """The longest sequence the model takes (``sources.config_context_length``), else the
    tokenizer's ``model_max_length``."""
    from ..sources import config_context_length

    v = config_context_length(config)
    if v:
        return v
    v = getattr(tokenizer, "model_max_length", None)
    return v if isinstance(v, int) and 0 < v < 10**8 else None


def mlx_memory() -> dict[str, int]:
    import mlx.core as mx

    return {"active_bytes": mx.get_active_memory(), "cache_bytes": mx.get_cache_memory(),
            "peak_bytes": mx.get_peak_memory()}


def grammar_stats() -> dict[str, Any]:
    from .grammar import STATS

    n = STATS["steps"]
    return {"constrained_tokens": n,
            "mask_ms_per_token": round(1000 * STATS["mask_seconds"] / n, 4) if n else None}
