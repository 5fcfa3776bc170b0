"""The array core that both front ends (the async client API and ``gpuremote.xp``) stand on.

- ``Buffer``: a device buffer of the proxy under a client-chosen handle, with its shadow host
  copy; it is freed (one ASYNC ``free``, batched with the next frame) when the last array on
  it is gone, or at once with ``free()``.
- ``infer``: the output shapes and dtypes of an op, computed once per signature (op, input
  shapes and dtypes, params) and then looked up: a loop that runs the same op on arrays of the
  same shape pays for the op's checks once. The proxy still checks what arrives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from . import ops

__all__ = ["Buffer", "infer", "signature"]


class Buffer:
    """A block of device memory on the proxy; ``host`` is a valid host copy of its bytes
    (uint8), if one is known, so that reading it costs no round trip."""

    __slots__ = ("__weakref__", "freed", "handle", "host", "nbytes", "release")

    def __init__(self, release: Callable[[int, int], None], handle: int, nbytes: int) -> None:
        self.release = release  # called with (handle, nbytes) once, when the buffer goes
        self.handle = handle
        self.nbytes = nbytes
        self.host: Any = None
        self.freed = False

    def invalidate(self) -> None:
        """The device wrote the buffer: the host copy is stale."""
        self.host = None

    def detach(self) -> bool:
        """Mark the buffer freed by its owner (no release when it goes); False if it was."""
        if self.freed:
            return False
        self.freed = True
        self.host = None
        return True

    def __del__(self) -> None:  # cheaper than weakref.finalize, and as prompt
        if not self.freed:  # at interpreter exit, or with the session gone, nothing to free
            with contextlib.suppress(Exception):
                self.release(self.handle, self.nbytes)


_CACHE: dict[Any, list[ops.Meta]] = {}
_CACHE_MAX = 1 << 15


def signature(name: str, metas: tuple[ops.Meta, ...], params: dict[str, Any]) -> Any:
    """What an op's output metadata depends on, as a hashable key; ``None`` if a param is not
    hashable (a list). A Python ``float``/``bool``/``complex`` scalar counts by its type only
    (the ops' rules look at nothing else); an ``int`` by its value too (range checks)."""
    if not params:
        return (name, metas)
    items = []
    for k, v in params.items():
        if k == "scalar" and type(v) is not int:
            v = type(v)
        items.append((k, v))
    key = (name, metas, *items)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def infer(name: str, metas: Sequence[ops.Meta], params: dict[str, Any]) -> list[ops.Meta]:
    """``ops.infer``, remembered per signature (errors are not remembered: they raise again)."""
    metas = tuple(metas)
    key = signature(name, metas, params)
    if key is not None:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
    out = ops.infer(name, metas, params)
    if key is not None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = out
    return out
