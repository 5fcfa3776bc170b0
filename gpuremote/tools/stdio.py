"""The process's stdout for ``--json``: one JSON object on it and nothing else, whatever
libraries outside Python (UCX) write to the descriptor meanwhile."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["json_stdout", "restore_stdout"]


@contextlib.contextmanager
def json_stdout() -> Iterator[None]:
    """For ``--json``: what this process writes to its stdout descriptor outside Python
    (UCX's log, a library's warnings) goes to stderr meanwhile, so that stdout holds the one
    JSON object that the command prints (through ``sys.stdout``) and nothing else."""
    sys.stdout.flush()
    try:
        real = os.dup(1)
    except OSError:  # no stdout to keep clean
        yield
        return
    os.dup2(2, 1)
    saved = sys.stdout
    sys.stdout = open(real, "w", encoding="utf-8", closefd=True)  # noqa: SIM115
    _REAL_STDOUT.append(real)
    try:
        yield
    finally:
        _REAL_STDOUT.remove(real)
        sys.stdout.flush()
        os.dup2(real, 1)
        sys.stdout.close()
        sys.stdout = saved


_REAL_STDOUT: list[int] = []


def restore_stdout() -> None:
    """Put the real stdout back on its descriptor (before ``exec``: the new program's
    stdout must be the real one)."""
    sys.stdout.flush()
    for real in _REAL_STDOUT:
        os.dup2(real, 1)
