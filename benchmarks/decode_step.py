"""Where one decode step's time goes, in-process (no server): the whole step, one layer,
its MLP and its attention, against a matrix-vector product over every weight.

    .venv/bin/python benchmarks/decode_step.py [--model builtin:tiny-50m] [--batch 1 32]
        [--context 256]

Prints median milliseconds; docs/performance.md ("Against the machine's limit") explains
what they showed on this machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxfleet.blas import preload_blas  # noqa: E402

BLAS = preload_blas()

import mlx.core as mx  # noqa: E402


def median_ms(fn, n: int = 9) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1000


def main() -> None:
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from mlxfleet.sources import resolve_source

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-50m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    model, _ = load(str(resolve_source(args.model)))
    a = model.args
    print(f"model {args.model}: {a.num_hidden_layers} layers, hidden {a.hidden_size}; "
          f"BLAS {BLAS or 'bundled'}; context {args.context} tokens")
    weights = [v for _, v in tree_flatten(model.parameters()) if v.ndim == 2]
    vecs = {w.shape[1]: mx.ones((1, w.shape[1])) for w in weights}
    print(f"matrix-vector product over every weight: "
          f"{median_ms(lambda: [vecs[w.shape[1]] @ w.T for w in weights]):.1f} ms")
    for b in args.batch:
        print(batch_line(model, b, args.context))


def batch_line(model, b: int, context: int) -> str:
    """One batch size: the step, one layer, its MLP, its attention and the SDPA call."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * context] * b), cache=cache))
    hidden = model.args.hidden_size
    layer = model.model.layers[0]
    attn = layer.self_attn
    x = mx.random.normal((b, 1, hidden))
    q = mx.random.normal((b, attn.n_heads, 1, hidden // attn.n_heads))
    c = cache[0]
    keys, values = mx.array(c.keys[..., :c.offset, :]), mx.array(c.values[..., :c.offset, :])
    mx.eval(x, q, keys, values)
    sdpa = median_ms(lambda: mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=attn.scale, mask=None))
    step = median_ms(lambda: model(mx.array([[7]] * b), cache=cache))
    return (f"batch {b}: step {step:.1f} ms; one layer {median_ms(lambda: layer(x, None, c)):.2f}"
            f" ms (MLP {median_ms(lambda: layer.mlp(x)):.2f}, attention "
            f"{median_ms(lambda: attn(x, mask=None, cache=c)):.2f}, of which "
            f"scaled_dot_product_attention {sdpa:.2f})")

if __name__ == "__main__":
    main()
