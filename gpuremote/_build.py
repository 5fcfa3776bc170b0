"""Which build of gpuremote's hot modules runs: compiled (by mypyc, where the install built
them: ``setup.py``) or their Python source.

A wheel and ``pip install .`` compile the modules of ``HOT`` where a C compiler is present;
an editable install (``pip install -e .``) runs the source, so that an edit takes effect at
once. Python imports a compiled module before its source when both lie side by side, with no
help from gpuremote: nothing here changes how modules are found. Where the compiled modules
sit in a source tree (``GPUREMOTE_COMPILE_EDITABLE=1`` compiles an editable install in
place), ``check`` warns at import about any whose source is newer than it: that one runs as
it was compiled until ``pip install -e .`` builds again.
"""

from __future__ import annotations

import importlib.machinery
import sys
import sysconfig
import warnings
from pathlib import Path

__all__ = ["HOT", "build", "check", "compiled_modules", "stale_modules"]

#: the modules of a synchronous op's path, client and proxy; compiled as one group
#: (``gpuremote._compiled__mypyc``), so that calls between them are C calls
HOT = (
    "gpuremote.wire.protocol",
    "gpuremote.wire.framing",
    "gpuremote.wire.limits",
    "gpuremote.wire.calls",
    "gpuremote.session.pipeline",
    "gpuremote.session.batching",
    "gpuremote.core.arrays",
    "gpuremote.core.driver",
    "gpuremote.proxy.state",
    "gpuremote.proxy.executor",
    "gpuremote.proxy.session",
    "gpuremote.proxy.devicequeue",
    "gpuremote.proxy.handlers.launches",
    "gpuremote.proxy.handlers.memory",
    "gpuremote.proxy.monitor",
    "gpuremote.proxy.scheduler",
)
_EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)
#: this Python's suffix of a compiled module
_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def compiled_modules() -> list[str]:
    """The hot modules that run compiled in this process (of those imported)."""
    return sorted(
        name
        for name in HOT
        if str(getattr(sys.modules.get(name), "__file__", "")).endswith(_EXTENSIONS)
    )


def build() -> str:
    """``"compiled"`` or ``"pure"``: what runs the hot path in this process (as the wire's
    protocol module, the first hot module ``gpuremote`` imports, was loaded)."""
    import gpuremote.wire.protocol as protocol

    return "compiled" if str(protocol.__file__).endswith(_EXTENSIONS) else "pure"


def stale_modules(root: Path | None = None) -> list[str]:
    """The compiled hot modules in the source tree at ``root`` (this install's, where it is
    an editable one; none elsewhere: an installed wheel's sources do not change) whose
    source is newer than them."""
    base = root or Path(__file__).resolve().parent.parent
    if not (base / "setup.py").is_file():
        return []
    stale = []
    for name in HOT:
        source = base.joinpath(*name.split(".")).with_suffix(".py")
        built = source.with_suffix(_SUFFIX)
        if built.is_file() and source.is_file() and source.stat().st_mtime > built.stat().st_mtime:
            stale.append(name)
    return stale


def check() -> None:
    """Warn if a compiled hot module is older than its source (one ``stat`` per module)."""
    stale = stale_modules()
    if stale:
        warnings.warn(
            f"gpuremote: compiled modules older than their sources run as they were compiled: "
            f"{', '.join(stale)} (pip install -e . builds them again; an editable install "
            "without GPUREMOTE_COMPILE_EDITABLE=1 runs the sources)",
            RuntimeWarning,
            stacklevel=3,
        )
