"""Facts read off a loaded model and the MLX runtime (engine thread only)."""

from __future__ import annotations

from typing import Any, Optional


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of K and V one token adds across all layers (0 if the shape is unknown)."""
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
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    out = []
    for c in make_prompt_cache(model):
        out += list(c.caches) if isinstance(c, CacheList) else [c]
    return out


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
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions",
                "seq_length"):
        v = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(v, int) and v > 0:
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
