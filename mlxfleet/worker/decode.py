"""Tokens to text on the engine thread: streaming detokenizer, stop strings, special tokens.

Matching stop strings where the tokens are made lets the engine drop a
finished sequence from the batch in the same step, with no round trip to the
event loop. mlx_lm's streaming detokenizer and ``TextStateMachine`` do the work.
"""

from __future__ import annotations

import codecs
from typing import Any, Optional

from mlx_lm.generate import TextStateMachine
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Tokens hidden from the output by default (vLLM's ``skip_special_tokens``): the
    tokenizer's special tokens and added tokens marked special. Added tokens that are
    not special (``<tool_call>``, ``<think>`` in Qwen-style vocabularies) stay visible:
    the tool-call and reasoning parsers need them."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    for i, tok in (getattr(inner, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return frozenset(ids)


def marker_ids(vocab: dict[str, int]) -> frozenset[int]:
    """The ids of the markers tool-call and reasoning parsers read (``formats.MARKERS``),
    in the tokenizer's ``vocab`` (its ``get_vocab()``)."""
    from ..formats import MARKERS

    return frozenset(vocab[m] for m in MARKERS if m in vocab)


class SequenceDecoder:
    """One sequence's visible text, token by token."""

    def __init__(self, tokenizer: Any, stops: list[str], skip: frozenset[int],
                 keep_leading_space: bool = False):
        self._detok = tokenizer.detokenizer
        if keep_leading_space:
            keep_space(self._detok)
        self._stops = stops
        self._skip = skip
        self._sm = TextStateMachine({"normal": [(s, None) for s in stops]}) if stops else None
        self._state = self._sm.make_state() if self._sm else None
        self._raw = ""
        self.text_len = 0  # characters shown so far
        self.finish_reason: Optional[str] = None
        self.stop_sequence: Optional[str] = None  # which stop string ended it

    def feed(self, token: int, finish_reason: Optional[str]) -> str:
        """Consume one token (``finish_reason`` from the batch: stop on EOS, length);
        return the text that may now be shown. Sets ``finish_reason`` when done,
        to "stop" when a stop string appeared in the text."""
        eos = finish_reason == "stop"  # the batch stops on EOS tokens only
        if not eos and token not in self._skip:
            self._detok.add_token(token)
            if self._detok._unflushed and isinstance(self._detok, BPEStreamingDetokenizer):
                release_undecodable(self._detok)
        if finish_reason is not None:
            self._detok.finalize()
        out = self._filter(self._detok.last_segment)
        if self.finish_reason is None and finish_reason is not None:
            self.finish_reason = finish_reason
            if self._state is not None:  # not a stop string after all: show it
                self._state, tail, _ = TextStateMachine.flush(self._state)
                out += tail
        self.text_len += len(out)
        return out

    def _filter(self, segment: str) -> str:
        if self._sm is None or not segment or self.finish_reason is not None:
            return segment if self.finish_reason is None else ""
        self._raw += segment
        self._state, segments = TextStateMachine.split(self._state, segment)
        out = "".join(t for s, t in segments if s is not None)
        if self._state[0] is None:
            self.finish_reason = "stop"
            self._state = None
            cut = self.text_len + len(out)
            found = [(self._raw.find(s, cut), s) for s in self._stops]
            self.stop_sequence = min((f for f in found if f[0] >= 0), default=(0, None))[1]
        return out


def keep_space(detok: Any) -> None:
    """Keep the text's first space. mlx-lm's streaming detokenizers drop it (right for
    a chat answer after a SentencePiece marker); a completion's text must be what its
    tokens say, so that ``prompt + text`` is what the model produced and logprobs'
    ``text_offset`` agree with it. (mlx-lm has the switch only for SentencePiece.)"""
    if hasattr(detok, "trim_space"):
        detok.trim_space = False
    if isinstance(detok, BPEStreamingDetokenizer):
        detok._maybe_trim_space = lambda text: text  # this copy only (see .detokenizer)


def release_undecodable(detok: BPEStreamingDetokenizer) -> None:
    """Show bytes that can never become a character, now.

    mlx-lm's BPE detokenizer holds its text back while the decoded tail is U+FFFD,
    waiting for the rest of a multi-byte character. A run of bytes that is not UTF-8 at
    all (small, quantized or untrained models emit them) was held that way to the end of
    the generation: the stream stalled, then everything came at once. Here only a tail
    that can still complete a character (at most 3 bytes) stays held; the rest is shown,
    with U+FFFD for the bad bytes, as mlx-lm's ``finalize`` would show it at the end."""
    pending = detok._unflushed
    table = _byte_decoder()
    raw, sizes = bytearray(), []
    for c in pending:  # as mlx-lm's _decode_bytes reads them
        b = table.get(c, False)
        if b:
            raw.append(b)
            sizes.append(1)
        else:
            raw.extend(c.encode())
            sizes.append(len(c.encode()))
    if not raw.decode("utf-8", "replace").endswith("\ufffd"):
        return  # not waiting on bytes (a lone space waits for the next token)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(bytes(raw), final=False)
    tail = len(decoder.getstate()[0])  # bytes that may still complete a character
    if not text:
        return  # only the start of a character so far: wait for the rest
    keep = held = 0
    for size in reversed(sizes):
        if held >= tail:
            break
        held += size
        keep += 1
    if held != tail:
        return  # the tail does not end on a token boundary: leave it to mlx-lm
    detok.text += detok._maybe_trim_space(text)
    detok._unflushed = pending[len(pending) - keep:] if keep else ""
