"""Tiny models the project builds itself (``builtin:`` sources).

No model hub is reachable from tests or CI, so we write real checkpoints
locally: a Qwen3-architecture model with deterministic random weights saved as
safetensors, a byte-level BPE tokenizer trained with ``tokenizers`` on a
deterministic corpus, and a ChatML chat template that supports tools. The
result is an ordinary Hugging Face / MLX directory, loaded by ``mlx_lm.load``
exactly like a downloaded model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .builtin_tokenizer import (
    BUILTIN_FORMAT,
    CHAT_TEMPLATE,
    CONTEXT_LENGTH,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    corpus,
    tokenizer_config,
    train_tokenizer,
)

#: name -> Qwen3 shape. ``tiny`` is for tests, ``tiny-50m`` for benchmarks.
BUILTIN_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "tiny-10m": dict(hidden_size=384, num_hidden_layers=6, intermediate_size=1024,
                     num_attention_heads=6, num_key_value_heads=2, head_dim=64),
    "tiny-50m": dict(hidden_size=512, num_hidden_layers=15, intermediate_size=1536,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}
BUILTIN_PREFIX = "builtin:"
DEMO = "demo"  # the trained chat model, shipped in mlxfleet/models/demo
EMBED = "tiny-embed"  # a BERT-family encoder with random weights, for spec.task: embedding
VLM = "tiny-vlm"  # a LLaVA vision-language model with random weights (needs mlx-vlm)
SCRIPTED = "scripted"  # answers from a script (mlxfleet/scripted.py): for testing clients
SCRIPTED_CONTEXT = 262144
BUILTIN_NAMES = [*BUILTIN_SIZES, DEMO, EMBED, VLM, SCRIPTED]
def _weights(shape: dict[str, int], vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights, scaled so greedy decoding has clear winners."""
    rng = np.random.default_rng(seed)
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    hd, nq, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]

    def lin(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    w = {"model.embed_tokens.weight": (rng.standard_normal((vocab, h)) * 0.5).astype(np.float32),
         "model.norm.weight": np.ones(h, np.float32)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(nq * hd, h)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, nq * hd)
        w[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        w[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
        w[p + "mlp.gate_proj.weight"] = lin(inter, h)
        w[p + "mlp.up_proj.weight"] = lin(inter, h)
        w[p + "mlp.down_proj.weight"] = lin(h, inter)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    return w


def write_checkpoint(out_dir: Path, tok, shape: dict[str, int], weights: dict,
                     name: str, readme: str, context: int = CONTEXT_LENGTH) -> Path:
    """Save a Qwen3 checkpoint (config, tokenizer with chat template, safetensors)."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eos = ids["<|im_end|>"]
    config = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        **shape,
        "vocab_size": tok.get_vocab_size(),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": eos,
        "bos_token_id": None,
        "mlxfleet": {"builtin": name, "format": BUILTIN_FORMAT},
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(ids, CHAT_TEMPLATE, context), indent=2))
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [eos], "pad_token_id": ids["<|endoftext|>"]}))
    save_file({k: np.asarray(v, dtype=np.float32) for k, v in weights.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "mlx"})
    (out_dir / "README.md").write_text(readme)
    return out_dir


def write_encoder(out_dir: Path, name: str, hidden: int = 64, layers: int = 2,
                  heads: int = 4, inter: int = 128, positions: int = 512) -> Path:
    """A BERT checkpoint in Hugging Face's layout (config, tokenizer, safetensors, the
    sentence-transformers pooling files), random weights: what ``task: embedding`` loads."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(corpus(), VOCAB_SIZE)
    tok.save(str(out_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "intermediate_size": inter, "max_position_embeddings": positions,
              "type_vocab_size": 2, "vocab_size": vocab, "layer_norm_eps": 1e-12,
              "hidden_act": "gelu", "mlxfleet": {"builtin": name, "format": BUILTIN_FORMAT}}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": positions,
        "pad_token": "<|endoftext|>", "unk_token": None, "bos_token": None,
        "clean_up_tokenization_spaces": False}))
    (out_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}))
    rng = np.random.default_rng(sum(map(ord, name)))

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    t = {"embeddings.word_embeddings.weight": w(vocab, hidden),
         "embeddings.position_embeddings.weight": w(positions, hidden),
         "embeddings.token_type_embeddings.weight": w(2, hidden),
         "embeddings.LayerNorm.weight": np.ones(hidden, np.float32),
         "embeddings.LayerNorm.bias": np.zeros(hidden, np.float32)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for part, (o, n) in {"attention.self.query": (hidden, hidden),
                             "attention.self.key": (hidden, hidden),
                             "attention.self.value": (hidden, hidden),
                             "attention.output.dense": (hidden, hidden),
                             "intermediate.dense": (inter, hidden),
                             "output.dense": (hidden, inter)}.items():
            t[p + part + ".weight"], t[p + part + ".bias"] = w(o, n), np.zeros(o, np.float32)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + norm + ".weight"] = np.ones(hidden, np.float32)
            t[p + norm + ".bias"] = np.zeros(hidden, np.float32)
    save_file(t, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "README.md").write_text(f"# builtin:{name}\n\nA BERT encoder with random "
                                       "weights, written by mlxfleet for tests.\n")
    return out_dir


def write_builtin(name: str, out_dir: Path) -> Path:
    """Write the builtin model ``name`` (e.g. ``tiny``) as a checkpoint in ``out_dir``."""
    if name == DEMO:
        shutil.copytree(demo_dir(), out_dir, dirs_exist_ok=True)
        return out_dir
    if name == EMBED:
        return write_encoder(out_dir, name)
    if name == VLM:
        from .builtin_vlm import write_vlm

        return write_vlm(out_dir, name)
    if name == SCRIPTED:
        from .scripted import write_scripted

        tok = train_tokenizer(corpus(), VOCAB_SIZE)
        write_scripted(out_dir, tok, {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
                       SCRIPTED_CONTEXT)
        return out_dir
    if name not in BUILTIN_SIZES:
        raise ValueError(f"unknown builtin model {name!r}; choose one of: "
                         f"{', '.join(BUILTIN_NAMES)}")
    shape = BUILTIN_SIZES[name]
    tok = train_tokenizer(corpus(), VOCAB_SIZE)
    weights = _weights(shape, tok.get_vocab_size(), seed=sum(map(ord, name)))
    readme = (f"# builtin:{name}\n\nA Qwen3-architecture model with deterministic random "
              "weights, written by mlxfleet for tests and benchmarks. It produces "
              "gibberish by design.\n")
    return write_checkpoint(out_dir, tok, shape, weights, name, readme)


def demo_dir() -> Path:
    """The trained demo model shipped inside the package (see scripts/train_demo.py)."""
    return Path(__file__).resolve().parent / "models" / "demo"


def builtin_cache_dir() -> Path:
    """Where builtin models are written once (``MLXFLEET_CACHE``, else XDG cache)."""
    root = os.environ.get("MLXFLEET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlxfleet")
    return Path(root) / "builtin"


def builtin_dir(name: str) -> Path:
    """Where builtin model ``name`` lives once written (it may not exist yet)."""
    return demo_dir() if name == DEMO else builtin_cache_dir() / f"{name}-v{BUILTIN_FORMAT}"


def ensure_builtin(name: str) -> Path:
    """Return the directory of builtin model ``name``, writing it on first use.

    Written to a temporary sibling and renamed, so concurrent workers never see
    a half-written model.
    """
    target = builtin_dir(name)
    if name == DEMO:
        return target  # shipped ready-made: nothing is trained at start
    return write_once(target, lambda tmp: write_builtin(name, tmp))


def write_once(target: Path, write) -> Path:
    """``target``, a checkpoint directory, written by ``write(tmp)`` unless it is there:
    into a temporary sibling then renamed, so concurrent processes never see half of it."""
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
