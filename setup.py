"""The optional build step: gpuremote's hot modules compiled to C extensions with mypyc.

Everything else about the package is in ``pyproject.toml``; this file only adds the extension
modules. The source stays Python, and a build falls back to it (with a warning, never an
error) where mypyc or a C compiler is missing or the C does not build. ``GPUREMOTE_COMPILE=0``
builds pure Python on purpose. ``gpuremote._native`` decides at import which one runs: the
compiled modules only where the manifest this build writes vouches for them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

#: the modules of a synchronous op's path, client and proxy (issue #41's step 3); compiled as
#: one group, so that calls between them are C calls
HOT = [
    "gpuremote/wire/protocol.py",
    "gpuremote/wire/framing.py",
    "gpuremote/wire/limits.py",
    "gpuremote/wire/calls.py",
    "gpuremote/session/pipeline.py",
    "gpuremote/core/arrays.py",
    "gpuremote/core/driver.py",
    "gpuremote/proxy/state.py",
    "gpuremote/proxy/executor.py",
    "gpuremote/proxy/session.py",
    "gpuremote/proxy/devicequeue.py",
    "gpuremote/proxy/handlers/launches.py",
    "gpuremote/proxy/handlers/memory.py",
    "gpuremote/proxy/monitor.py",
    "gpuremote/proxy/scheduler.py",
]
#: written by the build (not in git), read by ``gpuremote._native``: the modules compiled, for
#: which Python (extension suffix), by which mypy, from which sources (one hash of them all)
MANIFEST = HERE / "gpuremote" / "_native.json"


def _load_native() -> Any:
    """``gpuremote/_native.py`` by its path (importing ``gpuremote`` needs its dependencies)."""
    spec = importlib.util.spec_from_file_location(
        "_gpuremote_native", HERE / "gpuremote/_native.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_native = _load_native()
#: the command setuptools runs (pip's hooks: ``egg_info``/``dist_info`` for metadata, which
#: compile nothing; ``editable_wheel`` or ``bdist_wheel`` to build)
_COMMAND = sys.argv[1] if len(sys.argv) > 1 else ""
_BUILDS = {"build", "build_ext", "bdist_wheel", "bdist_egg", "editable_wheel", "develop", "install"}
#: the compiled modules go into the tree itself (an editable install): only then does the
#: build touch the tree's extension files and manifest (a wheel built from a tree with an
#: editable install leaves that install as it is)
_IN_PLACE = _COMMAND in ("editable_wheel", "develop") or (
    _COMMAND == "build_ext" and bool({"--inplace", "-i"} & set(sys.argv))
)
_NAMES = [path.removesuffix(".py").replace("/", ".") for path in HOT]


def _say(msg: str) -> None:
    print(f"gpuremote build: {msg}", file=sys.stderr)


def _has_c_compiler() -> bool:
    import sysconfig

    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None


def _mypy_version() -> str:
    try:
        from mypy.version import __version__
    except ImportError:
        return ""
    return str(__version__)


def _manifest(sources: str | None) -> dict[str, Any]:
    """What ``_native`` reads; ``sources=None``: nothing compiled."""
    if sources is None:
        return {"modules": []}
    return {
        "modules": _NAMES,
        "suffix": _native.SUFFIX,
        "mypy": _mypy_version(),
        "sources": sources,
    }


def _write(doc: dict[str, Any], where: Path = MANIFEST) -> None:
    where.write_text(json.dumps(doc, indent=1) + "\n")


def _extension_files() -> list[Path]:
    return [p for p in (HERE / "gpuremote").rglob("*") if p.suffix in (".so", ".pyd")]


def _pure_in_place() -> None:
    """No compiled module left in the tree (any Python's, any module's: each would be
    imported before its source), and a manifest that vouches for none."""
    for path in _extension_files():
        path.unlink(missing_ok=True)
    _write(_manifest(None))


def _kept() -> bool:
    """An editable install whose compiled modules, in place, were built for this Python by
    this mypy from these very sources: nothing to compile (``scripts/test.sh`` installs on
    every run)."""
    try:
        doc = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return False
    if doc != _manifest(_native.sources_digest(HERE)):
        return False
    return all(
        (HERE / name.replace(".", "/")).with_suffix(_native.SUFFIX).is_file()
        for name in [*_NAMES, "gpuremote._native__mypyc"]
    )


#: the sources' hash when mypyc read them (an edit during the C build makes them stale)
_SOURCES: str | None = None


class _BuildPy(build_py):
    """``build_py`` whose copy of the manifest vouches for nothing until ``build_ext`` has
    built the modules (a pure wheel must not carry an editable tree's manifest)."""

    def run(self) -> None:
        super().run()
        built = Path(self.build_lib) / "gpuremote"
        if built.is_dir():
            _write(_manifest(None), built / MANIFEST.name)


class _OptionalBuildExt(build_ext):
    """``build_ext`` whose failure leaves a pure-Python install (and says so); on success it
    writes the manifest: in the tree when built in place, in the build for a wheel."""

    def run(self) -> None:
        built = Path(self.build_lib) / "gpuremote"
        try:
            super().run()
        except Exception as exc:  # CompileError, LinkError, a missing header...
            _say(f"the compiled modules did not build ({exc}); installing pure Python")
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            if _IN_PLACE:
                _pure_in_place()
            if built.is_dir():
                _write(_manifest(None), built / MANIFEST.name)
            return
        if _IN_PLACE:
            _write(_manifest(_SOURCES))
        if built.is_dir():
            _write(_manifest(_SOURCES), built / MANIFEST.name)


def _pure(why: str) -> list[Any]:
    _say(f"{why}: pure Python")
    if _IN_PLACE:
        _pure_in_place()
    return []


def _extensions() -> list[Any]:
    global _SOURCES
    if _COMMAND not in _BUILDS:
        return []
    if os.environ.get("GPUREMOTE_COMPILE", "1") == "0":
        return _pure("GPUREMOTE_COMPILE=0")
    try:
        from mypyc.build import mypycify
    except ImportError:
        return _pure("mypyc is not installed")
    if _IN_PLACE and _kept():
        _say("the compiled modules are up to date with their sources: kept")
        return []
    if not _has_c_compiler():
        return _pure("no C compiler")
    _say(f"compiling {len(HOT)} modules with mypyc (a minute or two)")
    if _IN_PLACE:
        _pure_in_place()  # until the build has succeeded (an interrupted one leaves pure Python)
    _SOURCES = _native.sources_digest(HERE)  # before mypyc reads them
    cwd = os.getcwd()
    os.chdir(HERE)  # mypyc takes paths relative to the project
    try:
        exts = mypycify(HOT, opt_level="3", group_name="gpuremote._native")
    except (Exception, SystemExit) as exc:  # mypyc's own errors exit
        return _pure(f"mypyc failed ({exc!r})")
    finally:
        os.chdir(cwd)
    return list(exts)


setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": _OptionalBuildExt, "build_py": _BuildPy},
)
