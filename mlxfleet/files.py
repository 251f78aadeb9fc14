"""Reading a file someone else named (a manifest's ``warmPrompts``, a state file),
and writing files that hold conversations.

A named path may be a FIFO (reading it blocks forever), a device (``/dev/zero`` never
ends) or a huge file: ``read_regular`` opens without blocking, reads regular files
only and at most ``max_bytes``. Call it off the event loop. Files that hold prompts
or answers are the user's alone: ``private_dir`` and ``private_file``. A leaf.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``; OSError (with a
    reason a person can act on) for anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_size > max_bytes:
            raise OSError(f"{path} is {st.st_size} bytes; at most {max_bytes} are read")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew while we read
        raise OSError(f"{path} is over {max_bytes} bytes")
    return data


def private_dir(path: Path) -> Path:
    """``path`` created if needed, readable by this user only (0700)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def private_file(path: Path) -> Path:
    """``path`` (created empty if needed) readable by this user only (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)
    return path
