"""What a model's workers get and cost in memory (a part of ModelRuntime); the
scheduler asks for ``footprint``.

A footprint is max(estimate, measured): the estimate is the weights on disk,
the KV cache budget and a per-worker overhead; the measurement is the serving
worker's resident memory, once there is one.
"""

from __future__ import annotations

from typing import Optional

from ..worker_settings import WorkerConfig
from .placement import shard_share
from .worker_config import worker_config


def spec_weight_bytes(spec) -> Optional[int]:
    """A model's weights on disk (None while unknown), with its draft model's."""
    from ..sources import weight_bytes

    w = weight_bytes(spec.source, spec.revision)
    draft = spec.speculative.draft_model
    return w + (weight_bytes(draft) or 0) if w is not None and draft else w


def spec_sources(spec) -> list[tuple[str, Optional[str]]]:
    """The checkpoints a model's worker loads: its own, and its draft model's."""
    out = [(spec.source, spec.revision)]
    if spec.speculative.draft_model:
        out.append((spec.speculative.draft_model, None))
    return out


class MemoryAccount:
    """Mixed into ModelRuntime, whose fields it reads."""

    @property
    def worker_config(self) -> WorkerConfig:
        """What this model's workers are started with (manifest + server defaults)."""
        key = (self.manifest, self.rank)
        if self._config_for != key:
            self._config = worker_config(self.manifest, self.settings, self.rank)
            self._config_for = key
        return self._config

    def cache_bytes(self) -> int:
        return self.worker_config.cache_bytes

    def estimated_bytes(self) -> int:
        shards = len(self.rank[1]) if self.rank else 1  # a sharded model: this rank's share
        return (shard_share(self.weight_bytes or 0, shards) + self.cache_bytes()
                + (self.settings.worker_overhead_mb << 20))

    def memory_bytes(self) -> Optional[int]:
        w = self.current
        return w.memory_bytes() if w is not None else None

    def footprint(self) -> int:
        rss = self.memory_bytes()
        if rss:
            self.measured_bytes = max(self.measured_bytes or 0, rss)
        return max(self.estimated_bytes(), self.measured_bytes or 0)
