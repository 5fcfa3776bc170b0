"""``gpuremote.xp.fft``: the array API's Fourier transform extension, run on the proxy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._array import Array
from ._device import default_device
from ._functions import _axis, _dev, _dtype_param

__all__ = [
    "fft",
    "fftfreq",
    "fftn",
    "fftshift",
    "hfft",
    "ifft",
    "ifftn",
    "ifftshift",
    "ihfft",
    "irfft",
    "irfftn",
    "rfft",
    "rfftfreq",
    "rfftn",
]


def _one(name: str, x: Array, **params: Any) -> Array:
    return x._core.launch(f"fft.{name}", [x], params)[0]


def fft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> Array:
    """The 1-D discrete Fourier transform."""
    return _one("fft", x, n=n, axis=axis, norm=norm)


def ifft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> Array:
    """The inverse of ``fft``."""
    return _one("ifft", x, n=n, axis=axis, norm=norm)


def rfft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> Array:
    """The 1-D transform of real input (non-negative frequencies)."""
    return _one("rfft", x, n=n, axis=axis, norm=norm)


def irfft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> Array:
    """The inverse of ``rfft``."""
    return _one("irfft", x, n=n, axis=axis, norm=norm)


def hfft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> Array:
    """The transform of a Hermitian-symmetric signal (real output)."""
    return _one("hfft", x, n=n, axis=axis, norm=norm)


def ihfft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> Array:
    """The inverse of ``hfft``."""
    return _one("ihfft", x, n=n, axis=axis, norm=norm)


def _nd(name: str, x: Array, s: Sequence[int] | None, axes: Any, norm: str) -> Array:
    return _one(name, x, s=None if s is None else list(s), axes=_axis(axes), norm=norm)


def fftn(
    x: Array, /, *, s: Sequence[int] | None = None, axes: Any = None, norm: str = "backward"
) -> Array:
    """The n-D discrete Fourier transform."""
    return _nd("fftn", x, s, axes, norm)


def ifftn(
    x: Array, /, *, s: Sequence[int] | None = None, axes: Any = None, norm: str = "backward"
) -> Array:
    """The inverse of ``fftn``."""
    return _nd("ifftn", x, s, axes, norm)


def rfftn(
    x: Array, /, *, s: Sequence[int] | None = None, axes: Any = None, norm: str = "backward"
) -> Array:
    """The n-D transform of real input."""
    return _nd("rfftn", x, s, axes, norm)


def irfftn(
    x: Array, /, *, s: Sequence[int] | None = None, axes: Any = None, norm: str = "backward"
) -> Array:
    """The inverse of ``rfftn``."""
    return _nd("irfftn", x, s, axes, norm)


def _freq(name: str, n: int, d: float, dtype: Any, device: Any) -> Array:
    dev = _dev(device) if device is not None else default_device()
    if dtype is not None and _dtype_param(dtype) not in ("float32", "float64"):
        raise ValueError(f"{name}: dtype must be a real floating-point dtype, not {dtype}")
    return dev.launch(f"fft.{name}", [], {"n": n, "d": d, "dtype": _dtype_param(dtype)})[0]


def fftfreq(n: int, /, *, d: float = 1.0, dtype: Any = None, device: Any = None) -> Array:
    """The sample frequencies of ``fft``."""
    return _freq("fftfreq", n, d, dtype, device)


def rfftfreq(n: int, /, *, d: float = 1.0, dtype: Any = None, device: Any = None) -> Array:
    """The sample frequencies of ``rfft``."""
    return _freq("rfftfreq", n, d, dtype, device)


def fftshift(x: Array, /, *, axes: Any = None) -> Array:
    """The zero frequency moved to the centre."""
    return _one("fftshift", x, axes=_axis(axes))


def ifftshift(x: Array, /, *, axes: Any = None) -> Array:
    """The inverse of ``fftshift``."""
    return _one("ifftshift", x, axes=_axis(axes))
