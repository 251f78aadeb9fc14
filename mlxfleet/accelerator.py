"""The device a node's models run on, and the memory they may use there.

MLX runs on Apple's GPU (Metal, unified memory), on an NVIDIA GPU (its CUDA backend:
the models live in the GPU's own memory) or on the CPU. The memory budget, placement
and eviction count in what the models' device holds: Metal's recommended working set, a
share of the GPU's memory on CUDA, a share of RAM on the CPU.

The gateway never initialises a GPU to find out (a CUDA context costs hundreds of MB in
every process that makes one): which backend MLX will use is read from the installed
packages (``mlx-metal``, ``mlx-cuda-12``/``-13``, ``mlx-cpu``), Metal is asked through
MLX (as before, on macOS only), and an NVIDIA GPU through ``nvidia-smi``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

#: The share of an NVIDIA GPU's memory the models may use (the rest: MLX's own buffers,
#: the CUDA context, other processes).
CUDA_SHARE = 0.9


@dataclass(frozen=True)
class Accelerator:
    """What this node computes on."""

    kind: str  # "metal", "cuda" or "cpu"
    name: str  # "Apple M2 Max", "NVIDIA H100 80GB HBM3", "cpu"
    memory_bytes: Optional[int] = None  # what models may use there (None: a share of RAM)
    source: str = ""  # where that figure comes from (get models, /v1/status)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "memoryBytes": self.memory_bytes,
                "memorySource": self.source}


def backend(installed: Callable[[str], bool] = None) -> str:  # type: ignore[assignment]
    """The MLX backend the installed packages give: metal, cuda or cpu."""
    have = installed or _installed
    if sys.platform == "darwin":
        return "metal"
    if have("mlx-cuda-13") or have("mlx-cuda-12"):
        return "cuda"
    return "cpu"


def check_backend() -> None:
    """On Linux, refuse to start (one clear line) when no MLX backend is installed: every
    worker would fail to import MLX."""
    if sys.platform != "linux" or any(_installed(d) for d in (
            "mlx-cpu", "mlx-cuda-13", "mlx-cuda-12")):
        return
    raise SystemExit("error: MLX has no backend on this machine: pip install "
                     "'mlxfleet[cpu]', or 'mlxfleet[cuda]' with an NVIDIA GPU ('[cuda12]' "
                     "for drivers older than CUDA 13); scripts/setup.sh picks one")


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def nvidia_gpus(run: Callable = subprocess.run) -> list[tuple[str, int]]:
    """(name, total memory in bytes) of each NVIDIA GPU, from ``nvidia-smi``."""
    if run is subprocess.run and shutil.which("nvidia-smi") is None:
        return []
    try:
        out = run(["nvidia-smi", "--query-gpu=name,memory.total",
                   "--format=csv,noheader,nounits"], capture_output=True, text=True,
                  timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        name, _, mib = line.rpartition(",")
        if name.strip() and mib.strip().isdigit():
            gpus.append((name.strip(), int(mib.strip()) << 20))
    return gpus


def _metal() -> Accelerator:
    try:
        import mlx.core as mx

        if mx.metal.is_available():
            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            size = int(info.get("max_recommended_working_set_size") or 0) or None
            return Accelerator("metal", str(info.get("device_name") or "Apple GPU"), size,
                               "Metal recommended working set")
    except Exception:  # noqa: BLE001 - no Metal answer: a share of RAM, as on the CPU
        pass
    return Accelerator("cpu", "cpu")


def detect(kind: Optional[str] = None, gpus: Optional[list[tuple[str, int]]] = None
           ) -> Accelerator:
    """This node's accelerator (``kind`` and ``gpus``: given by tests, else found)."""
    kind = kind or backend()
    if kind == "metal":
        return _metal()
    if kind == "cuda":
        found = nvidia_gpus() if gpus is None else gpus
        if found:  # MLX uses the first device
            name, total = found[0]
            return Accelerator("cuda", name, int(total * CUDA_SHARE),
                               f"{CUDA_SHARE:.0%} of {name}'s memory")
        return Accelerator("cuda", "NVIDIA GPU (nvidia-smi did not answer)")
    return Accelerator("cpu", "cpu")


@functools.cache
def this_node() -> Accelerator:
    """This machine's accelerator, found once."""
    return detect()
