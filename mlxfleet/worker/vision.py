"""Vision-language models on the engine thread (mlx-vlm), batched with everything else.

A VLM is a vision tower and a language model. Images only matter while the prompt
is read: the vision tower turns them into embeddings that take the place of the
image tokens. So the engine reads a prompt with images here (``prefill``: vision
tower, then the language model over the merged embeddings, into a fresh KV cache)
and hands the filled cache to mlx-lm's ``BatchGenerator`` exactly like a prompt-cache
hit: from there on the sequence decodes in the same batch as text requests, through
``TextModel``, the language model seen as an mlx-lm model. Text-only requests to a
VLM never touch the vision tower.

Language models that keep per-request position state (M-RoPE: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL) cannot share a batch this way; they are refused at load with a clear error
rather than decoded with wrong positions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

#: The language models whose positions live in their own state (see the docstring).
MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe")


def image_token_id(config: dict, processor: Any) -> int:
    for key in ("image_token_index", "image_token_id"):
        v = config.get(key)
        if isinstance(v, int):
            return v
    tok = getattr(processor, "tokenizer", processor)
    token = getattr(processor, "image_token", None) or "<image>"
    return int(tok.convert_tokens_to_ids(token))


class VisionModel:
    """A loaded VLM: the full model (for prompts with images), the language model as an
    mlx-lm model (for the batch), its processor and the id of its image token."""

    def __init__(self, path: Path, trust_remote_code: bool = False):
        try:
            import mlx_vlm
        except ImportError:
            raise RuntimeError("this is a vision-language model: install mlx-vlm "
                               "(pip install 'mlxfleet[vision]')") from None
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") in MROPE_TYPES:
            raise RuntimeError(
                f"{config['model_type']} models (M-RoPE positions) are not supported yet: "
                "their positions cannot be batched with other requests")
        self.model, self.processor = mlx_vlm.load(str(path),
                                                  trust_remote_code=trust_remote_code)
        self.config = config
        self.text = _text_model(self.model.language_model)
        self.image_token = image_token_id(config, self.processor)

    def prefill(self, ids: list[int], features: dict[str, Any], cache: list[Any],
                step: int) -> None:
        """Read ``ids`` (which hold every image's tokens) into ``cache``, images merged."""
        import mlx.core as mx

        x = mx.array(ids)[None]
        kwargs = {k: mx.array(v) for k, v in features.items()}
        pixels = kwargs.pop("pixel_values", None)
        embeds = self.model.get_input_embeddings(x, pixels, **kwargs).inputs_embeds
        lm = self.model.language_model
        for s in range(0, len(ids), step):  # chunked like mlx-lm's prefill
            lm(x[:, s:s + step], inputs_embeds=embeds[:, s:s + step], cache=cache)
            mx.eval([c.state for c in cache])


def _text_model(lm: Any):
    import mlx.nn as nn

    class TextModel(nn.Module):
        """mlx-vlm's language model with mlx-lm's interface: ``model(tokens, cache)``
        returns logits; ``layers``, ``args`` and ``make_cache`` as mlx-lm expects."""

        def __init__(self, lm: Any):
            super().__init__()
            self.lm = lm
            self.args = getattr(lm, "config", None)
            if hasattr(lm, "make_cache"):
                self.make_cache = lm.make_cache

        @property
        def layers(self):
            return self.lm.layers

        def __call__(self, inputs, cache=None, input_embeddings: Optional[Any] = None):
            out = self.lm(inputs, cache=cache, inputs_embeds=input_embeddings)
            return getattr(out, "logits", out)

    return TextModel(lm)
