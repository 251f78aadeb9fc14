"""``builtin:tiny-vlm``: a LLaVA-architecture vision-language checkpoint with random weights.

Written like the other builtins (see ``builtin.py``): a real byte-level BPE tokenizer
with an ``<image>`` token, a chat template that places images, a CLIP image processor
config and a processor config, and safetensors. ``mlx_vlm.load`` reads it exactly as it
reads a LLaVA checkpoint from the hub. The parameter names and shapes are taken from
mlx-vlm's own LLaVA module so they always match the installed version.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32  # pixels; with 8-pixel patches: 16 image tokens per image
PATCH_SIZE = 8

# ChatML, with OpenAI-style content parts: an image part becomes the image token, which
# the processor expands to one token per image patch.
CHAT_TEMPLATE = r"""{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\n' }}
{%- if message.content is string %}{{- message.content }}
{%- else %}{%- for part in message.content %}
{%- if part.type in ('image', 'image_url', 'input_image') %}{{- '<image>' }}
{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}
{%- endfor %}{%- endif %}
{{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def write_vlm(out_dir: Path, name: str) -> Path:
    """Write the tiny VLM to ``out_dir`` (needs mlx-vlm, like serving it does)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import llava
    from safetensors.numpy import save_file

    from .builtin_tokenizer import (
        BUILTIN_FORMAT,
        CONTEXT_LENGTH,
        SPECIAL_TOKENS,
        VOCAB_SIZE,
        corpus,
        tokenizer_config,
        train_tokenizer,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    specials = [*SPECIAL_TOKENS, IMAGE_TOKEN]
    tok = train_tokenizer(corpus(), VOCAB_SIZE, specials)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in specials}
    eos = ids["<|im_end|>"]
    vocab = tok.get_vocab_size()
    text = dict(model_type="llama", hidden_size=64, num_hidden_layers=2,
                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=CONTEXT_LENGTH, tie_word_embeddings=True)
    vision = dict(model_type="clip_vision_model", hidden_size=32, num_hidden_layers=2,
                  intermediate_size=64, num_attention_heads=2, image_size=IMAGE_SIZE,
                  patch_size=PATCH_SIZE, projection_dim=32, num_channels=3,
                  layer_norm_eps=1e-5)
    config = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
              "text_config": text, "vision_config": vision,
              "image_token_index": ids[IMAGE_TOKEN], "vision_feature_layer": -2,
              "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
              "vocab_size": vocab, "eos_token_id": eos, "torch_dtype": "float32",
              "mlxfleet": {"builtin": name, "format": BUILTIN_FORMAT}}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    model = llava.Model(llava.ModelConfig.from_dict(
        {**config, "text_config": llava.TextConfig.from_dict(text),
         "vision_config": llava.VisionConfig.from_dict(vision)}))
    rng = np.random.default_rng(sum(map(ord, name)))
    weights = {}
    for key, value in tree_flatten(model.parameters()):
        shape = tuple(value.shape)
        if key.endswith("norm.weight") or "layer_norm" in key or "layernorm" in key:
            w = np.ones(shape) if key.endswith("weight") else np.zeros(shape)
        elif key.endswith("bias"):
            w = np.zeros(shape)
        else:  # scaled so greedy decoding has clear winners, as for the text builtins
            w = rng.standard_normal(shape) / np.sqrt(max(shape[-1], 1))
            if "embed_tokens" in key:
                w = rng.standard_normal(shape) * 0.5
        weights[key] = w.astype(np.float32)
    del model
    mx.clear_cache()
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "mlx"})

    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(ids, CHAT_TEMPLATE, CONTEXT_LENGTH), indent=2))
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "do_resize": True, "size": {"shortest_edge": IMAGE_SIZE},
        "do_center_crop": True, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True, "resample": 3}, indent=2))
    (out_dir / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default", "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 1}, indent=2))
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [eos], "pad_token_id": ids["<|endoftext|>"]}))
    (out_dir / "README.md").write_text(
        f"# builtin:{name}\n\nA LLaVA-architecture vision-language model (CLIP vision "
        "tower, Llama language model) with random weights, written by mlxfleet for tests. "
        "It produces gibberish by design.\n")
    return out_dir
