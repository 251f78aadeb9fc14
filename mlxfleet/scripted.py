"""``builtin:scripted``: a model that answers from a script, for testing clients.

Random weights never call a tool, and real models are too big for CI, so agent clients
(Claude Code, Codex, opencode, ...) are tested against this one: rules say "when the
conversation matches this regex, answer that text". The answer still goes through
everything a real model's would: the real tokenizer and chat template (the builtin
ChatML one, Hermes-style ``<tool_call>`` markup), mlx-lm's batch generator and sampler,
the prompt cache, the tool-call and reasoning parsers and every protocol's formatter.
Only the forward pass is scripted: at each step it puts all the probability on the next
token of the answer.

How it knows the conversation inside mlx-lm's batch: its one "layer" caches each
token's id (plus one, so the batch's zero padding is no token) as a 1-dimensional key
and the token's position (plus one) as its value, so every row's cache holds that row's
whole sequence, however it was batched, trimmed or reused from the prompt cache. Like a
real model's attention it reads only the slots past a row's left padding, in any order
(speculative decoding's cut-back moves slots: ``speculative.relocate``): it sorts them
by position.

The script is JSON: ``{"rules": [{"when": REGEX, "say": TEXT}, ...], "otherwise": TEXT}``.
``when`` is searched in the conversation as the template rendered it (the first match
wins); ``say`` may use the match's groups as ``\\g<name>`` or ``\\g<1>`` (nothing else in
it is an escape). It comes from the file
named by ``MLXFLEET_SCRIPT`` in the worker's environment (a manifest's ``spec.env``), else
a ``script`` in the checkpoint's ``config.json``, else ``DEFAULT_SCRIPT`` (which says it is
a placeholder and how to use a real model). Not for answering people: it knows only its script.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs

MODEL_TYPE = "mlxfleet_scripted"
#: What the template writes before each answer (the builtin ChatML template's).
ANSWER_MARKER = "<|im_start|>assistant\n"
#: The probability all but one token gets: exp(-BIG) is nothing at any temperature <= 2.
BIG = 200.0
#: Inputs up to this many tokens get logits at every position (see ``Model.__call__``).
SCORED_POSITIONS = 64

DEFAULT_SCRIPT = {
    "rules": [{"when": r"<tool_response>\s*(?P<result>.*?)\s*</tool_response>\s*<\|im_end\|>"
                       r"\s*<\|im_start\|>assistant\n$",
               "say": "The tool answered: \\g<result>"}],
    "otherwise": ("This is mlxfleet's placeholder for agent clients: a scripted model, "
                  "not a language model. Point its manifest's `source` at a real model "
                  "(for example mlx-community/Qwen3-Coder-30B-A3B-Instruct-4bit) and keep "
                  "its aliases; see docs/integrations.md."),
}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    eos_token_id: Any = None
    script: dict = field(default_factory=lambda: DEFAULT_SCRIPT)
    # Benchmarks: [width, layers] of matrices multiplied at every token, so that a
    # scripted answer takes as long as a real model's (see benchmarks/speculative.py).
    ballast: Optional[list] = None


class _Script:
    def __init__(self, script: dict[str, Any]):
        self.rules = [(re.compile(r["when"], re.S), r["say"]) for r in script.get("rules", [])]
        self.otherwise = script.get("otherwise", DEFAULT_SCRIPT["otherwise"])

    def answer(self, conversation: str) -> str:
        for pattern, say in self.rules:
            m = pattern.search(conversation)
            if m:  # only \g<name> / \g<1> are replaced: the rest is the text as written
                return re.sub(r"\\g<(\w+)>", lambda g, m=m: m.group(
                    int(g[1]) if g[1].isdigit() else g[1]) or "", say)
        return self.otherwise


def load_script(default: dict[str, Any]) -> _Script:
    path = os.environ.get("MLXFLEET_SCRIPT")
    if path:
        with open(path, encoding="utf-8") as f:
            return _Script(json.load(f))
    return _Script(default)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.vocab_size = args.vocab_size
        self.scale = mx.ones((1,))  # its one weight: mlx-lm loads at least one file
        self.script = load_script(args.script)
        eos = args.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos
        self.tokenizer: Any = None  # given by the engine after loading (attach_tokenizer)
        self._answers: OrderedDict[tuple, list[int]] = OrderedDict()
        self._marker: list[int] = []
        self._ballast = _Ballast(args.vocab_size, *args.ballast) if args.ballast else None

    def attach_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._marker = tokenizer.encode(ANSWER_MARKER, add_special_tokens=False)

    @property
    def layers(self) -> list:
        return [None]  # one cache: make_cache() below

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache

        return [KVCache()]

    def __call__(self, inputs: mx.array, cache: Optional[list] = None, **kwargs) -> mx.array:
        b, n = inputs.shape
        ids = (inputs.astype(mx.float32) + 1)[:, None, :, None]  # (B, heads, L, dim)
        if cache is not None and cache[0] is not None:
            c = cache[0]
            first = mx.array(c.offset).reshape(-1, 1)  # each row's next position
            pos = (first + mx.arange(1, n + 1)).astype(mx.float32)
            keys, values = c.update_and_fetch(ids, mx.broadcast_to(pos, (b, n))[:, None, :, None])
            pad = c.left_padding.tolist() if hasattr(c, "left_padding") else [0] * b
            slots = zip(keys[:, 0, :, 0].astype(mx.int32).tolist(),
                        values[:, 0, :, 0].astype(mx.int32).tolist(), pad)
            rows = [[t for _, t in sorted(zip(p[lp:], k[lp:]))] for k, p, lp in slots]
        else:
            rows = (inputs + 1).tolist()
        # Every position's next token for a few positions (speculative decoding verifies
        # a draft by them); a prompt chunk's positions before its last are never read.
        width = n if n <= SCORED_POSITIONS else 1
        nxt = [self._next([t - 1 for t in row if t > 0], width) for row in rows]
        hot = mx.array(nxt)[:, :, None] == mx.arange(self.vocab_size)[None, None, :]
        logits = mx.where(hot, BIG, -BIG) * self.scale
        logits = logits + self._weigh(inputs)[:, n - width:] if self._ballast else logits
        if width == n:
            return logits
        return mx.concatenate([mx.zeros((b, n - 1, self.vocab_size)), logits], axis=1)

    def _weigh(self, inputs: mx.array) -> mx.array:
        """Nothing (zero), computed at a real model's cost (``ballast``: benchmarks)."""
        h = self._ballast.embed[inputs]
        for w in self._ballast.layers:
            h = mx.tanh(h @ w)
        return 0 * h[..., :1]

    def _next(self, tokens: list[int], width: int = 1) -> list[int]:
        """The next token of the answer this conversation gets, after each of its last
        ``width`` positions (eos before the answer starts: never read)."""
        first = len(tokens) - width + 1  # the shortest prefix asked about
        starts, hi = [], len(tokens)  # where answers start, latest first
        while self._marker and self.tokenizer is not None:
            at = _rfind(tokens, self._marker, hi)
            if at < 0:
                break
            starts.append(at + len(self._marker))
            if starts[-1] <= first:
                break
            hi = starts[-1] - 1  # (a draft can hold a marker: look further back)
        out = []
        for end in range(first, len(tokens) + 1):
            start = next((s for s in starts if s <= end), None)
            answer = self._answer(tuple(tokens[:start])) if start is not None else []
            written = end - start if start is not None else -1
            out.append(answer[written] if 0 <= written < len(answer) else self.eos)
        return out

    def _answer(self, prompt: tuple) -> list[int]:
        """The answer's tokens (then eos) for the conversation up to its answer marker."""
        answer = self._answers.get(prompt)
        if answer is None:
            text = self.tokenizer.decode(list(prompt))
            answer = self.tokenizer.encode(self.script.answer(text),
                                           add_special_tokens=False) + [self.eos]
            self._answers[prompt] = answer
            while len(self._answers) > 256:
                self._answers.popitem(last=False)
        else:
            self._answers.move_to_end(prompt)
        return answer

    def sanitize(self, weights: dict) -> dict:
        return weights


class _Ballast:
    """Random matrices that are not parameters (not in the checkpoint): a plain object,
    which ``nn.Module`` does not look into."""

    def __init__(self, vocab: int, width: int, layers: int):
        key = mx.random.key(0)
        self.embed = mx.random.normal((vocab, width), key=key) * 0.02
        self.layers = [mx.random.normal((width, width), key=mx.random.split(key, layers)[i])
                       * width ** -0.5 for i in range(layers)]
        mx.eval(self.embed, self.layers)


def _rfind(seq: list[int], sub: list[int], end: Optional[int] = None) -> int:
    """The last start of ``sub`` in ``seq[:end]``, or -1."""
    for i in range((len(seq) if end is None else end) - len(sub), -1, -1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


def register() -> None:
    """Make mlx-lm find this model type (it imports ``mlx_lm.models.<model_type>``)."""
    sys.modules.setdefault(f"mlx_lm.models.{MODEL_TYPE}", sys.modules[__name__])


def write_scripted(out_dir, tok, ids: dict[str, int], context: int) -> None:
    """The checkpoint: the builtin tokenizer and template, a config naming this model
    type (a long declared context: the model costs nothing per token), one weight."""
    import numpy as np
    from safetensors.numpy import save_file

    from .builtin_tokenizer import CHAT_TEMPLATE, tokenizer_config

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    eos = ids["<|im_end|>"]
    config = {"model_type": MODEL_TYPE, "vocab_size": tok.get_vocab_size(),
              "max_position_embeddings": context, "num_hidden_layers": 1,
              "num_key_value_heads": 1, "head_dim": 1, "hidden_size": 1,
              "eos_token_id": eos, "torch_dtype": "float32",
              "mlxfleet": {"builtin": "scripted"}}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(ids, CHAT_TEMPLATE, context), indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    save_file({"scale": np.ones((1,), dtype=np.float32)}, str(out_dir / "model.safetensors"),
              metadata={"format": "mlx"})
    (out_dir / "README.md").write_text(
        "# builtin:scripted\n\nA model that answers from a script, for testing clients "
        "(see mlxfleet/scripted.py). Not for answering people.\n")
