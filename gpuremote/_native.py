"""Which build of gpuremote's hot modules runs: compiled (mypyc, where the install built them;
see ``setup.py``) or their Python source.

Imported first by ``gpuremote``, before any hot module. The compiled modules run only where
``_native.json``, written by the build that made them, vouches for them: made for this
Python's extension suffix, every one present, and (in a source tree: an editable install)
from the sources as they are now. Anything else runs the Python source, and every
``gpuremote`` module is then imported from its ``.py`` even where an extension file lies
beside it (one left by another build, another Python, an interrupted install):
``GPUREMOTE_PURE=1`` asks for that (profiling, debugging: cProfile sees no calls inside
compiled code), and an edited source gets it with a warning, until ``pip install -e .``
compiles again. Either way the same code runs; compiled, it costs about half the time.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

__all__ = ["build", "compiled_modules", "pure_reason", "sources_digest"]

_ROOT = Path(__file__).resolve().parent.parent  # the folder above the package
#: the extension suffix of this Python: a build for another one does not count
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _source(name: str) -> Path:
    return _ROOT.joinpath(*name.split(".")).with_suffix(".py")


def sources_digest(root: Path) -> str:
    """One hash of every ``.py`` of the package under ``root`` (``gpuremote/`` and, in the
    source tree, ``transports/``; not ``bench/``, which no compiled module imports): compiled
    modules depend on the types of what they import, so a change anywhere makes them stale."""
    h = hashlib.sha256()
    for folder in ("gpuremote", "transports"):
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def _manifest() -> dict[str, object]:
    try:
        doc = json.loads((_ROOT / "gpuremote" / "_native.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _in_source_tree() -> bool:
    """An editable install: the package is the project's own folder (sources can change)."""
    return (_ROOT / "setup.py").is_file() and (_ROOT / "pyproject.toml").is_file()


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Finds every ``gpuremote`` module but ``compiled`` as its ``.py`` source, ahead of any
    extension file beside it."""

    def __init__(self, compiled: frozenset[str]) -> None:
        self.compiled = compiled

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("gpuremote.") or fullname in self.compiled:
            return None
        src = _source(fullname)
        return importlib.util.spec_from_file_location(fullname, src) if src.is_file() else None


def _vouched() -> tuple[frozenset[str], str | None, bool]:
    """The compiled modules this install may run, else why none (and whether to warn)."""
    if os.environ.get("GPUREMOTE_PURE", "") not in ("", "0"):
        return frozenset(), "GPUREMOTE_PURE is set", False
    doc = _manifest()
    mods = doc.get("modules")
    if not isinstance(mods, list) or not mods:
        return frozenset(), "not compiled at install (no mypyc, no C compiler, or not asked)", False
    names = frozenset(str(m) for m in mods)
    if doc.get("suffix") != SUFFIX:
        return frozenset(), f"compiled for another Python ({doc.get('suffix')})", False
    missing = sorted(n for n in names if not _source(n).with_suffix(SUFFIX).is_file())
    if not (_ROOT / "gpuremote" / f"_native__mypyc{SUFFIX}").is_file():
        missing.append("gpuremote._native__mypyc")
    if missing:
        return frozenset(), f"compiled modules missing ({', '.join(missing)})", True
    if _in_source_tree() and doc.get("sources") != sources_digest(_ROOT):
        return frozenset(), "the sources changed since they were compiled", True
    return names, None, False


def _choose() -> tuple[frozenset[str], str | None]:
    compiled, reason, warn = _vouched()
    if warn:
        warnings.warn(
            f"gpuremote: running the Python source of its compiled modules: {reason} "
            "(pip install -e . compiles them again)",
            RuntimeWarning,
            stacklevel=3,
        )
    sys.meta_path.insert(0, _SourceFirst(compiled))
    return compiled, reason


_COMPILED, _PURE_REASON = _choose() if __name__ == "gpuremote._native" else (frozenset(), None)


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
