"""Fast CPU BLAS on Linux.

The ``mlx[cpu]`` wheel resolves its BLAS symbols (``cblas_sgemm`` ...) from a slow
bundled reference implementation (~8 GFLOP/s). Loading an OpenBLAS into the
process with ``RTLD_GLOBAL`` *before* ``import mlx`` makes those symbols resolve
to OpenBLAS instead: 20-30x faster matmuls, hence prompt processing and
batched decoding. On macOS, MLX uses Metal and Accelerate; nothing to do.

``MLXFLEET_BLAS``: ``auto`` (default: use an OpenBLAS if one is installed),
``off``, or the path of a BLAS shared library.

OpenBLAS's idle threads spin (``sched_yield``) for 2^28 cycles, about 0.1 s, after each
matrix product before they sleep; between a model's matmuls and a worker's steps that
is always, so a busy worker kept every core it had, spinning. They now spin 2^20 cycles
(under a millisecond: ``OPENBLAS_THREAD_TIMEOUT``, kept when set). Measured on 2 cores,
``builtin:tiny`` through the gateway, alternating starts: the server's CPU for a burst of
256 streams 12.2-12.6 s against 17.1-18.5 s (128 streams: 5.6-6.5 against 8.3-9.9), its
tokens/s 0.98x at 256 and 0.99x at 128 streams (medians of 3), inside the noise
(docs/performance.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from typing import Optional

_CANDIDATES = [
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]

#: log2 of the cycles OpenBLAS's threads spin before they sleep (its default is 28)
THREAD_TIMEOUT = "20"

#: What ``preload_blas`` chose: a library path, "bundled" or "native".
active: str = "bundled" if sys.platform.startswith("linux") else "native"


def _find_openblas() -> Optional[str]:
    arch = os.uname().machine
    for pattern in _CANDIDATES:
        for path in glob.glob(pattern.format(arch=arch)):
            return path
    name = ctypes.util.find_library("openblas")
    return name


def preload_blas(setting: Optional[str] = None) -> str:
    """Load a fast BLAS before MLX; returns what is in use. Call before ``import mlx``."""
    global active
    if not sys.platform.startswith("linux"):
        return active
    setting = (setting or os.environ.get("MLXFLEET_BLAS") or "auto").strip()
    if setting == "off":
        return active
    if "mlx.core" in sys.modules:
        return active  # too late: MLX already bound its BLAS
    path = _find_openblas() if setting == "auto" else setting
    if not path:
        return active
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)  # read at its load
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        if setting != "auto":
            raise RuntimeError(f"MLXFLEET_BLAS={setting}: cannot load it: {e}") from None
        return active
    active = path
    return active
