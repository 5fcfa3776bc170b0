"""The allow-listed ops that ``launch`` may run: the array API standard's functions, one
module per category of the standard, plus gpuremote's own fused ops (``nn``).

Each op has a ``meta`` function, run on the client to infer the shapes and dtypes of its
outputs by the standard's rules (no round trip) and on the proxy to check what a client
declared, and a ``run`` function, called on the proxy with ``xp`` (numpy or cupy), the input
arrays, the output arrays it writes into, and the params. A name that is not in ``OPS`` is an
error: no op is ever looked up by a name that came from the network other than in this table.

The table is built here from each category module's ``OPS`` list; no module registers
anything as a side effect of being imported.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import (
    creation,
    dtypes,
    elementwise,
    fft,
    indexing,
    linalg,
    manipulation,
    nn,
    searching,
    sets,
    sorting,
    statistical,
)
from ._base import (
    CATEGORIES,
    Meta,
    Op,
    OpError,
    OpTypeError,
    Params,
    Shape,
    broadcast,
    promote,
    scalar_dtype,
)
from .indexing import decode_index, index_shape
from .linalg import matmul_shape

__all__ = [
    "CATEGORIES",
    "MODULES",
    "OPS",
    "Meta",
    "Op",
    "OpError",
    "OpTypeError",
    "Params",
    "Shape",
    "broadcast",
    "decode_index",
    "index_shape",
    "infer",
    "matmul_shape",
    "promote",
    "scalar_dtype",
]

#: the category modules, in the order of the standard's specification
MODULES = (
    creation,
    dtypes,
    elementwise,
    indexing,
    linalg,
    manipulation,
    searching,
    sets,
    sorting,
    statistical,
    fft,
    nn,
)


def _table() -> dict[str, Op]:
    table: dict[str, Op] = {}
    for module in MODULES:
        for op in module.OPS:
            if op.name in table:
                raise RuntimeError(f"op {op.name!r} is defined twice")
            table[op.name] = op
    return table


#: every op by name
OPS: dict[str, Op] = _table()


def infer(name: str, inputs: Sequence[Meta], params: Params) -> list[Meta]:
    """Output shapes and dtypes of op ``name``; raises ``OpError`` for what it cannot take."""
    op = OPS.get(name)
    if op is None:
        raise OpError(f"unknown op {name!r}")
    lo, hi = op.nin
    if not lo <= len(inputs) <= hi:
        raise OpError(f"{name} takes {lo}..{hi} array inputs, got {len(inputs)}")
    extra = set(params) - set(op.params)
    if extra:
        raise OpError(f"{name} takes no parameter(s) {sorted(extra)}")
    return op.meta(inputs, params)
