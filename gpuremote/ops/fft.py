"""The standard's ``fft`` extension (``fft.<name>``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._base import (
    Meta,
    OpError,
    OpList,
    Params,
    Shape,
    axis_arg,
    check,
    dtype_param,
    norm_axes,
    one_axis,
    real_of,
)

__all__ = ["FFT", "OPS"]

OPS = OpList()

_COMPLEX_OF: dict[np.dtype[Any], np.dtype[Any]] = {
    np.dtype(np.float32): np.dtype(np.complex64),
    np.dtype(np.float64): np.dtype(np.complex128),
}
FFT: dict[str, tuple[str, str, str]] = {
    # name: (input category, output "complex" / "real", length rule)
    "fft": ("complex floating-point", "complex", "n"),
    "ifft": ("complex floating-point", "complex", "n"),
    "rfft": ("real floating-point", "complex", "half"),
    "irfft": ("complex floating-point", "real", "full"),
    "hfft": ("complex floating-point", "real", "full"),
    "ihfft": ("real floating-point", "complex", "half"),
    "fftn": ("complex floating-point", "complex", "n"),
    "ifftn": ("complex floating-point", "complex", "n"),
    "rfftn": ("real floating-point", "complex", "half"),
    "irfftn": ("complex floating-point", "real", "full"),
}


def _fft_axes(name: str, shape: Shape, params: Params) -> tuple[list[int], list[int | None]]:
    """The transformed axes and the requested length along each (None: the input's)."""
    if not name.endswith("n"):
        if not shape:
            raise OpError(f"{name} needs at least one dimension")
        n = params.get("n")
        if n is not None and (type(n) is not int or n < 1):
            raise OpError(f"{name}: n must be a positive int")
        return [one_axis(name, params.get("axis", -1), len(shape))], [n]
    s, axes = params.get("s"), params.get("axes")
    if axes is None:
        axes = (
            list(range(len(shape))) if s is None else list(range(len(shape) - len(s), len(shape)))
        )
    ax = list(norm_axes(name, axes, len(shape), allow_none=False))
    if s is not None and (len(s) != len(ax) or any(type(v) is not int or v < 1 for v in s)):
        raise OpError(f"{name}: s must give a positive length for each axis")
    return ax, list(s) if s is not None else [None] * len(ax)


def _make_fft(name: str, category: str, result: str, rule: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        check(name, dt, category)
        if params.get("norm", "backward") not in ("backward", "ortho", "forward"):
            raise OpError(f"{name}: norm must be 'backward', 'ortho' or 'forward'")
        axes, lengths = _fft_axes(name, shape, params)
        out = list(shape)
        for i, (a, n) in enumerate(zip(axes, lengths, strict=True)):
            last = i == len(axes) - 1
            m = shape[a] if n is None else n
            if rule == "half" and last:
                m = m // 2 + 1
            elif rule == "full" and last and n is None:
                m = 2 * (shape[a] - 1)
            if m < 1:
                raise OpError(f"{name}: invalid number of points {m}")
            out[a] = m
        odt = real_of(dt) if result == "real" else _COMPLEX_OF.get(dt, dt)
        return [(tuple(out), odt)]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        kw: dict[str, Any] = {"norm": params.get("norm", "backward")}
        if name.endswith("n"):
            kw["s"] = None if params.get("s") is None else tuple(params["s"])
            kw["axes"] = None if params.get("axes") is None else tuple(params["axes"])
        else:
            kw["n"], kw["axis"] = params.get("n"), params.get("axis", -1)
        return getattr(ns.fft, name)(ins[0], **kw)

    OPS.add(f"fft.{name}", (1, 1), meta, call, ("n", "axis", "s", "axes", "norm"))


for _name, (_cat, _res, _rule) in FFT.items():
    _make_fft(_name, _cat, _res, _rule)


def _freq_meta(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        n, d = params.get("n"), params.get("d", 1.0)
        if type(n) is not int or n < 1 or type(d) not in (int, float):
            raise OpError(f"{name} needs a positive int n and a number d")
        dt = dtype_param(params) or np.dtype(np.float64)
        if dt.kind != "f":
            raise OpError(f"{name}: dtype must be a real floating-point dtype")
        return [((n if name == "fftfreq" else n // 2 + 1,), dt)]

    return meta


def _fft_call(name: str) -> Callable[[Any, Sequence[Any], Params], Any]:
    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        fn = getattr(ns.fft, name)
        if name.endswith("freq"):
            return fn(params["n"], d=params.get("d", 1.0))
        return fn(ins[0], axes=axis_arg(params, "axes"))

    return call


for _name in ("fftfreq", "rfftfreq"):
    OPS.add(f"fft.{_name}", (0, 0), _freq_meta(_name), _fft_call(_name), ("n", "d", "dtype"))


def _shift_meta(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        check(name, dt, "floating-point")
        norm_axes(name, params.get("axes"), len(shape))
        return [(shape, dt)]

    return meta


for _name in ("fftshift", "ifftshift"):
    OPS.add(f"fft.{_name}", (1, 1), _shift_meta(_name), _fft_call(_name), ("axes",))
