"""Which build of gpuremote's hot modules runs: compiled (mypyc, where the install built them;
see ``setup.py``) or their Python source.

Imported first by ``gpuremote``, before any hot module. The Python source runs instead of the
compiled modules when ``GPUREMOTE_PURE=1`` (profiling, debugging: cProfile sees no calls inside
compiled code) or when a compiled module is older than its source (an editable install whose
source changed since the build: the edit runs, with a warning, until ``pip install -e .``
builds again). Either way the same code runs; compiled, it is ~40% cheaper per call.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

__all__ = ["build", "compiled_modules", "pure_reason"]

_ROOT = Path(__file__).resolve().parent.parent  # the folder above the package


def _source(name: str) -> Path:
    return _ROOT.joinpath(*name.split(".")).with_suffix(".py")


def _built() -> dict[str, str]:
    """The modules the build compiled, each with its source's hash (``_native.json``)."""
    try:
        data = json.loads((_ROOT / "gpuremote" / "_native.json").read_text())
        mods = data["modules"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {str(k): str(v) for k, v in mods.items()} if isinstance(mods, dict) else {}


def _changed(built: dict[str, str]) -> list[str]:
    changed = []
    for name, digest in built.items():
        try:
            if hashlib.sha256(_source(name).read_bytes()).hexdigest() != digest:
                changed.append(name)
        except OSError:  # no source beside the compiled module: nothing to be older than
            pass
    return changed


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Finds ``names`` as their ``.py`` source, ahead of the compiled extension beside it."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        src = _source(fullname)
        return importlib.util.spec_from_file_location(fullname, src) if src.exists() else None


def _choose() -> tuple[frozenset[str], str | None]:
    built = _built()
    if not built:
        return frozenset(), "not compiled at install (no mypyc, no C compiler, GPUREMOTE_COMPILE=0)"
    if os.environ.get("GPUREMOTE_PURE", "") not in ("", "0"):
        reason = "GPUREMOTE_PURE is set"
    else:
        changed = _changed(built)
        if not changed:
            return frozenset(built), None
        reason = f"{', '.join(changed)} changed since the build"
        warnings.warn(
            f"gpuremote: running the Python source of its compiled modules: {reason} "
            "(pip install -e . compiles them again)",
            RuntimeWarning,
            stacklevel=3,
        )
    sys.meta_path.insert(0, _SourceFirst(frozenset(built)))
    return frozenset(), reason


_COMPILED, _PURE_REASON = _choose()


def compiled_modules() -> list[str]:
    """The hot modules running compiled in this process (imported ones only)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted(
        name
        for name in _COMPILED
        if str(getattr(sys.modules.get(name), "__file__", "")).endswith(suffixes)
    )


def pure_reason() -> str | None:
    """Why the hot modules run as Python source here (``None``: they run compiled)."""
    return _PURE_REASON


def build() -> str:
    """``"compiled"`` or ``"pure"``: what runs the hot path in this process."""
    return "pure" if _PURE_REASON is not None else "compiled"
