"""A Qwen3-shaped checkpoint of a real model's size with random bf16 weights.

    .venv/bin/python benchmarks/synthetic_model.py OUT [--hidden 2048 --layers 28 ...]

The defaults are issue #46's "1-2B bf16 model" (1.4B parameters: hidden 2048, 28 layers,
intermediate 6144, 16 heads, 8 KV heads of 128), for compare.py on a GPU where no hub is
reachable. Tokenizer and chat template are builtin:tiny's (a small vocabulary, so the
parameters are nearly all in the layers). MLX draws the weights on its default device, so
a GPU writes 1.4B parameters in seconds; `mlx_lm.load` reads the result like any
checkpoint. Random weights repeat one token, which prompt lookup drafts perfectly: the
tokens/s are a server's at that size, not a trained model's acceptance.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxfleet.blas import preload_blas  # noqa: E402

preload_blas()

#: copied from builtin:tiny beside the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write(out: Path, hidden: int, layers: int, intermediate: int, heads: int,
          kv_heads: int, head_dim: int, dtype: str = "bfloat16", seed: int = 0) -> int:
    """Write the checkpoint to ``out``; returns its parameter count."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    from mlxfleet.builtin import ensure_builtin

    tiny = ensure_builtin("tiny")
    config = json.loads((tiny / "config.json").read_text())
    config.pop("mlxfleet", None)  # not a builtin: served as the directory it is
    config.update(hidden_size=hidden, num_hidden_layers=layers,
                  intermediate_size=intermediate, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, torch_dtype=dtype)
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return sum(w.size for w in weights.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--intermediate", type=int, default=6144)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = ap.parse_args()
    n = write(a.out, a.hidden, a.layers, a.intermediate, a.heads, a.kv_heads, a.head_dim,
              a.dtype)
    print(f"wrote {n / 1e6:,.0f}M parameters ({a.dtype}) to {a.out}")


if __name__ == "__main__":
    main()
