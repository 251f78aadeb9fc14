"""KV cache quantization inside continuous batching (``spec.cache.kvBits``).

mlx-lm 0.32 has ``QuantizedKVCache`` for one sequence, and its attention reads a cache's
quantized keys and values (``quantized_scaled_dot_product_attention``, chosen by the
cache having ``bits``), but ``BatchGenerator`` batches sequences through
``BatchKVCache``, which has no quantized version. ``BatchQuantizedKVCache`` is that
version: the same left-padded layout, write index and operations (filter, extend,
extract, merge, trim, the right-padding roll), applied to each of the three arrays a
quantized tensor is (packed values, scales, biases), all laid out ``(B, heads, T, d)``.

``QuantizedCache`` is one sequence's cache that can join such a batch. A model is given
these caches by ``quantize_kv`` (its ``make_cache``), so every path that makes a cache
(the batch, a lone prompt, warm prompts, the KV-size measurement) quantizes alike.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, dynamic_roll

#: Quantization group sizes tried, largest first (the head dimension must divide).
GROUP_SIZES = (64, 32)


class QuantizedCache(QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` that joins a batch (``merge``)."""

    def size(self) -> int:
        return self.offset

    def merge(self, caches: list) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


def _parts(c: Any) -> list:
    """The six arrays of a quantized cache (keys' then values' packed, scales, biases)."""
    return [*c.keys, *c.values]


def _set(c: Any, parts: list) -> None:
    c.keys, c.values = tuple(parts[:3]), tuple(parts[3:])


class BatchQuantizedKVCache(BatchKVCache):
    """``BatchKVCache`` whose keys and values are stored quantized."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys, values):
        prev, n = self._idx, keys.shape[2]
        new = [*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
               *mx.quantize(values, group_size=self.group_size, bits=self.bits)]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            B, H = keys.shape[:2]
            steps = (self.step + n - 1) // self.step * self.step
            grown = []
            olds = _parts(self) if self.keys is not None else [None] * len(new)
            for old, x in zip(olds, new):
                z = mx.zeros((B, H, steps, x.shape[-1]), dtype=x.dtype)
                if old is not None and prev % self.step:
                    old = old[..., :prev, :]
                grown.append(z if old is None else mx.concatenate([old, z], axis=2))
            _set(self, grown)
        self.offset = self.offset + n
        self._idx += n
        for a, x in zip(_parts(self), new):
            a[..., prev:self._idx, :] = x
        return self.keys_and_values()

    def keys_and_values(self):
        cut = [x[..., :self._idx, :] for x in _parts(self)]
        return tuple(cut[:3]), tuple(cut[3:])

    def finalize(self):
        if self._right_padding is not None:
            padding = self._right_padding
            _set(self, [dynamic_roll(x, padding[:, None], axis=2) for x in _parts(self)])
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices):
        if self.keys is not None:
            _set(self, [x[batch_indices] for x in _parts(self)])
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        least = min(self.left_padding.tolist())
        if least > 0:
            if self.keys is not None:
                _set(self, [x[..., least:, :] for x in _parts(self)])
            self._idx -= least
            self.left_padding -= least

    def extend(self, other):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        top = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = _parts(self if self.keys is not None else other)

        def pad(c):
            parts = _parts(c) if c.keys is not None else [
                mx.zeros((c.offset.shape[0], x.shape[1], 0, x.shape[3]), dtype=x.dtype)
                for x in like]
            left = top - c._idx
            right = size - parts[0].shape[2] - left
            if right < 0:
                parts, right = [x[..., :right, :] for x in parts], 0
            if left or right:
                parts = [mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]) for x in parts]
            return parts, c.left_padding + left

        (mine, my_pad), (theirs, their_pad) = pad(self), pad(other)
        _set(self, [mx.concatenate([a, b]) for a, b in zip(mine, theirs)])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([my_pad, their_pad])
        self._idx = top

    def extract(self, idx):
        cache = QuantizedCache(self.group_size, self.bits)
        padding = self.left_padding.tolist()[idx]
        _set(cache, [mx.contiguous(x[idx:idx + 1, :, padding:self._idx])
                     for x in _parts(self)])
        cache.offset = cache.keys[0].shape[2]
        return cache

    @classmethod
    def merge(cls, caches: list) -> BatchQuantizedKVCache:
        first = caches[0]
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        out = cls(padding, first.group_size, first.bits)
        if longest == 0:
            return out
        like = _parts(next(c for c in caches if c.keys is not None))
        parts = [mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), dtype=x.dtype)
                 for x in like]
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for a, x in zip(parts, _parts(c)):
                a[i:i + 1, :, p:p + c.offset] = x[..., :c.offset, :]
        _set(out, parts)
        out.offset += longest
        out._idx = longest
        return out

    @property
    def nbytes(self):
        return 0 if self.keys is None else sum(x.nbytes for x in _parts(self))


def group_size_for(model: Any) -> Optional[int]:
    """The largest quantization group that divides the width of every layer's keys and
    values (read off one token through a fresh cache); None when none does."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    dims = {c.keys.shape[-1] for c in caches} | {c.values.shape[-1] for c in caches}
    return next((g for g in GROUP_SIZES if all(d % g == 0 for d in dims)), None)


def reads_quantized(model: Any, bits: int, group_size: int) -> bool:
    """Whether the model's attention reads quantized batched caches: tried on two
    left-padded rows (mlx-lm's MLA attention, DeepSeek's, does not)."""
    caches = [BatchQuantizedKVCache([1, 0], group_size, bits) for _ in model.layers]
    try:
        mx.eval(model(mx.zeros((2, 2), dtype=mx.uint32), cache=caches))
    except Exception:  # noqa: BLE001 - whatever the architecture raises: not supported
        return False
    return True


def quantization_group(model: Any, bits: int, sharded: bool = False,
                       vision: bool = False) -> tuple[Optional[int], Optional[str]]:
    """(the group size the model's caches quantize with, None) or (None, why they
    cannot)."""
    from .model_facts import cache_kinds

    kinds = cache_kinds(model)
    if sharded:
        return None, "a sharded model keeps full-precision caches"
    if vision:
        return None, "vision models keep full-precision caches"
    if kinds != ["KVCache"]:
        return None, f"mlx-lm has no quantized version of its caches ({', '.join(kinds)})"
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    if any(type(c) is not KVCache for c in make_prompt_cache(model)):  # (a CacheList)
        return None, "its layers keep several caches each (DeepSeek-V3.2's indexer)"
    group = group_size_for(model)
    if group is None:
        return None, "its key and value widths are not multiples of 32"
    if not reads_quantized(model, bits, group):
        return None, "its attention (in mlx-lm) does not read quantized caches"
    return group, None


def quantize_kv(model: Any, bits: int, group_size: int) -> None:
    """From now on the model's caches are ``QuantizedCache``s of ``bits`` bits."""
    layers = len(model.layers)
    model.make_cache = lambda: [QuantizedCache(group_size, bits) for _ in range(layers)]


def portable(cache: list) -> list:
    """A cache mlx-lm's ``save_prompt_cache`` can write and read back (it restores
    caches by their class name: ``QuantizedCache`` is written as its parent)."""
    out = []
    for c in cache:
        if isinstance(c, QuantizedCache):
            q = QuantizedKVCache(c.group_size, c.bits)
            q.keys, q.values, q.offset = c.keys, c.values, c.offset
            c = q
        out.append(c)
    return out


def batchable(cache: list) -> list:
    """A cache read back from disk (mlx-lm restores ``QuantizedKVCache``): one that can
    join the batch."""
    out = []
    for c in cache:
        if type(c) is QuantizedKVCache:
            q = QuantizedCache(c.group_size, c.bits)
            q.keys, q.values, q.offset = c.keys, c.values, c.offset
            c = q
        out.append(c)
    return out
