"""The client's side of an op's template (``gpuremote.proxy.templates``): the first call of
an op signature keeps it on the proxy (``aten_template``: the operands' layouts, the
arguments with their floats left open, the outputs' layouts); later calls of it send only
where their operands are and the floats' values (``aten_call``, ``_dispatch``)."""

from __future__ import annotations

import itertools
from typing import Any

from ..core.driver import SyncDriver
from ..wire.calls import CALLS_BY_NAME
from ._encoding import Encoder

__all__ = ["keep", "with_holes"]

_ATEN_TEMPLATE = CALLS_BY_NAME["aten_template"]
#: the op signatures a session keeps on its proxy (below the proxy's ``max_templates``):
#: past them, an op of a new signature goes whole, as an ``aten`` call
_MOST_TEMPLATES = 1 << 14


def keep(
    d: SyncDriver, key: Any, name: str, encode: Encoder, wire_args: list[Any], metas: Any
) -> int:
    """Keep the signature ``key`` of op ``name`` (its outputs' ``metas``) on session ``d``'s
    proxy (one ASYNC ``aten_template``); its handle, 0 where the session keeps as many as it
    may (below what the proxy announced: its calls then go whole). ``d.templates[key]``:
    the handle and the metas, found by one lookup per call."""
    operands = [[0, 0, *desc[2:]] for desc in encode.descs]
    made = [[0, 0, m[0], m[1], m[4]] for m in metas[0] if m is not None]
    info = d.info  # (a proxy that keeps none announces no limit: calls go whole)
    kept = d.counters.get("templates", 0)  # (``d.templates`` holds other keys of some too)
    held = d.counters.get("template_tensors", 0) + len(operands) + len(made)
    if kept >= min(_MOST_TEMPLATES, info.get("max_templates", 0)) or held > (
        info.get("max_template_tensors", 0) // 2
    ):
        return 0
    handle = d.session.new_handle()
    d.post(_ATEN_TEMPLATE, 0, [handle, name, operands, with_holes(wire_args), made])
    d.templates[key] = (handle, metas)
    d.counters.update(templates=kept + 1, template_tensors=held)
    return handle


def with_holes(wire_args: list[Any]) -> list[Any]:
    """An op's wire ``[args, kwargs]`` with each float as ``{"f": i}``, numbered in the order
    the encoder met them (a template's: each call gives their values)."""
    count = itertools.count()

    def holes(v: Any) -> Any:
        if type(v) is float:
            return {"f": next(count)}
        if type(v) is list:
            return [holes(x) for x in v]
        return v  # (a tagged value: a tensor, a dtype, a complex...)

    args, kwargs = wire_args
    return [[holes(v) for v in args], {k: holes(v) for k, v in kwargs.items()}]
