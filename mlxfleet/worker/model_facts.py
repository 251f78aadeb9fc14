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
