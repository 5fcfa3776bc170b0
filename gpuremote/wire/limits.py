"""The limits that both ends of the wire agree on, defined once.

The proxy refuses what is past them (``gpuremote.wire.protocol`` checks every argument against
them before anything is allocated); the client keeps within them before it sends, so that a
call it cannot send fails alone, at once, naming itself. Limits that an operator may change
(frame and batch sizes, a session's memory) are settings instead: ``FrameLimits``
(``gpuremote.wire.framing``) and ``SessionLimits`` (``gpuremote.proxy.executor``).
"""

from __future__ import annotations

__all__ = [
    "MAX_ATEN_DEPTH",
    "MAX_HANDLE",
    "MAX_LIST",
    "MAX_NAME",
    "MAX_PARAMS",
    "MAX_PARAM_LIST",
    "MAX_SIZE",
    "MAX_STEP_ARRAYS",
    "MAX_TENSORS",
    "MAX_TEXT",
    "MAX_TICKETS_PER_SESSION",
    "WIRE_INT_MAX",
    "WIRE_INT_MIN",
]

#: the largest handle (client-chosen ids are non-negative 63-bit ints)
MAX_HANDLE = (1 << 63) - 1
#: the largest size or offset in bytes
MAX_SIZE = 1 << 62
#: the longest name (an op's, a kernel's, a param's key or string value)
MAX_NAME = 128
#: the longest text (a kernel's source, a URL, a ticket)
MAX_TEXT = 1 << 20
#: the longest list of arrays or handles in one argument (a call's inputs, the frees of one
#: command, a step's arguments and results)
MAX_LIST = 64
#: the most arguments and results of a recorded step (a compiled PyTorch graph takes every
#: parameter of its model, and its forward returns what the backward needs)
MAX_STEP_ARRAYS = 4096
#: the most tensor operands of one ATen op (``aten``): a ``_foreach_`` op of an optimizer
#: takes a few lists of every parameter of a model
MAX_TENSORS = 4096
#: how deep an ATen op's arguments nest (its argument list, a list in it, a list in that)
MAX_ATEN_DEPTH = 3
#: the most entries of a launch's params
MAX_PARAMS = 32
#: the most ints in one list-valued param (an encoded index has four per item)
MAX_PARAM_LIST = 256
#: the range of integers the wire (msgpack) carries
WIRE_INT_MIN, WIRE_INT_MAX = -(1 << 63), (1 << 64) - 1
#: arrays a proxy holds exported (``peer_export``) for one session at a time, until read
MAX_TICKETS_PER_SESSION = 16
