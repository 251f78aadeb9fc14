"""A prompt's next-token logits from one forward pass, projected at its last position only.

mlx-lm reads a new prompt in two passes: all but its last token (the cache alone), then
the last token (its logits). That keeps the vocabulary projection off every prompt
position, but it reads every weight twice; for a short prompt, the second pass costs about
as much as the first (measured on builtin:tiny-50m, CPU: 12 tokens in two passes 71 ms,
in one 49 ms; 128 tokens 218 ms and 200 ms). Here the whole prompt goes through the
model's body in one pass and only the body's last position reaches the head: every model
whose ``model.model`` is its body gets that by swapping the body's class, for the one
call, for a subclass that returns its last position only. Whatever the model does after
its body (a tied or separate head, soft-capping, scaling, the unknown-id mask) is applied
as the model applies it. ``supported`` checks that the result matches the model's own
logits before the engine relies on it. Engine thread only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


@functools.cache
def _last_only(cls: type) -> type:
    """``cls`` whose output keeps its last position only ([B, L, H] -> [B, 1, H])."""

    def __call__(self, *args, **kwargs):
        return cls.__call__(self, *args, **kwargs)[:, -1:]

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})


@contextlib.contextmanager
def last_position_only(model: Any) -> Iterator[None]:
    """Within the block, ``model(x)`` computes its head at ``x``'s last position only."""
    body = model.model
    cls = type(body)
    body.__class__ = _last_only(cls)
    try:
        yield
    finally:
        body.__class__ = cls


def supported(model: Any) -> bool:
    """Whether ``last_position_only`` gives ``model``'s own last-position logits (checked
    on a 4-token prompt: the same shape, values and greedy token)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    body = getattr(model, "model", None)
    if body is None or not callable(body):
        return False
    x = mx.array([[1, 2, 3, 4]])
    try:
        full = model(x, cache=make_prompt_cache(model))[:, -1, :]
        with last_position_only(model):
            last = model(x, cache=make_prompt_cache(model))
        if last.shape != (1, 1, full.shape[-1]):
            return False
        a, b = full.astype(mx.float32), last[:, -1, :].astype(mx.float32)
        scale = float(mx.abs(a).max().item()) or 1.0
        same = bool(mx.allclose(a, b, rtol=1e-2, atol=1e-2 * scale).item()) and \
            int(mx.argmax(a).item()) == int(mx.argmax(b).item())
    except Exception as e:  # noqa: BLE001 - a body of another shape: keep two passes
        log.debug("one-pass prompts unsupported: %s", e)
        return False
    return same
