"""Fast CPU BLAS on Linux.

The ``mlx[cpu]`` wheel resolves its BLAS symbols (``cblas_sgemm`` ...) from a slow
bundled reference implementation (~8 GFLOP/s). Loading an OpenBLAS into the
process with ``RTLD_GLOBAL`` *before* ``import mlx`` makes those symbols resolve
to OpenBLAS instead: 20-30x faster matmuls, hence prompt processing and
batched decoding. On macOS, MLX uses Metal and Accelerate; nothing to do.

``MLXFLEET_BLAS``: ``auto`` (default: use an OpenBLAS if one is installed),
``off``, or the path of a BLAS shared library.
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
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        if setting != "auto":
            raise RuntimeError(f"MLXFLEET_BLAS={setting}: cannot load it: {e}") from None
        return active
    active = path
    return active
