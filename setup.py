"""The optional build step: gpuremote's hot modules compiled to C extensions with mypyc.

Everything else about the package is in ``pyproject.toml``; this file only adds the extension
modules. The source stays Python, and a build falls back to it (with a warning, never an
error) where mypyc or a C compiler is missing or the C does not build. ``GPUREMOTE_COMPILE=0``
builds pure Python on purpose. ``gpuremote._native`` decides at import which one runs
(``GPUREMOTE_PURE=1``, or compiled modules older than their sources, run the Python).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

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
    "gpuremote/proxy/scheduler.py",
]
#: what the build compiled, by module, with the hash of the source it compiled; read by
#: ``gpuremote._native`` (generated, not in git)
MANIFEST = HERE / "gpuremote" / "_native.json"


def _say(msg: str) -> None:
    print(f"gpuremote build: {msg}", file=sys.stderr)


def _has_c_compiler() -> bool:
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None


def _hashes(paths: list[str]) -> dict[str, str]:
    return {
        path.removesuffix(".py").replace("/", "."): hashlib.sha256(
            (HERE / path).read_bytes()
        ).hexdigest()
        for path in paths
    }


def _mypy_version() -> str:
    try:
        from mypy.version import __version__
    except ImportError:
        return ""
    return __version__


def _write_manifest(compiled: list[str], where: Path = MANIFEST) -> None:
    doc = {"mypy": _mypy_version(), "modules": _hashes(compiled)}
    where.write_text(json.dumps(doc, indent=1) + "\n")


def _kept() -> bool:
    """An editable install whose compiled modules, in place, were built from these very
    sources by this mypyc: nothing to compile again (``scripts/test.sh`` installs each run)."""
    if "editable_wheel" not in sys.argv:
        return False  # a wheel carries what it builds
    try:
        doc = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict) or doc.get("mypy") != _mypy_version():
        return False
    if doc.get("modules") != _hashes(HOT):
        return False
    names = [*doc["modules"], "gpuremote._native__mypyc"]
    return all(Path(_inplace_path(name)).exists() for name in names)


class _OptionalBuildExt(build_ext):
    """``build_ext`` whose failure leaves a pure-Python install (and says so); on success it
    writes the manifest, in the tree (an editable install reads it there) and in the build."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # CompileError, LinkError, a missing header...
            _say(f"the compiled modules did not build ({exc}); installing pure Python")
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            _pure_python()
            return
        in_place = [*_hashes(HOT), "gpuremote._native__mypyc"]
        if all(Path(_inplace_path(name)).exists() for name in in_place):  # editable
            _write_manifest(HOT)
        built = Path(self.build_lib) / "gpuremote"
        if built.is_dir():  # the wheel's copy
            _write_manifest(HOT, built / MANIFEST.name)


def _inplace_path(name: str) -> str:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return str(HERE / (name.replace(".", "/") + suffix))


def _pure_python() -> list[object]:
    """No compiled modules: none left in the tree (an earlier editable build's would be
    imported before the source), and a manifest that lists none."""
    for path in HOT:
        Path(_inplace_path(path.removesuffix(".py").replace("/", "."))).unlink(missing_ok=True)
    Path(_inplace_path("gpuremote._native__mypyc")).unlink(missing_ok=True)
    _write_manifest([])
    return []


#: the setuptools commands that build (metadata alone, ``egg_info``/``dist_info``, compiles nothing)
_BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def _extensions() -> list[object]:
    if not _BUILDS.intersection(sys.argv[1:]):
        return []
    if os.environ.get("GPUREMOTE_COMPILE", "1") == "0":
        _say("GPUREMOTE_COMPILE=0: pure Python")
        return _pure_python()
    try:
        from mypyc.build import mypycify
    except ImportError:
        _say("mypyc is not installed: pure Python")
        return _pure_python()
    if _kept():
        _say("the compiled modules are up to date with their sources: kept")
        return []
    if not _has_c_compiler():
        _say("no C compiler: pure Python")
        return _pure_python()
    _say(f"compiling {len(HOT)} modules with mypyc (a minute or two)")
    _pure_python()  # until the build has succeeded (an interrupted one leaves pure Python)
    cwd = os.getcwd()
    os.chdir(HERE)  # mypyc takes paths relative to the project
    try:
        exts = mypycify(HOT, opt_level="3", group_name="gpuremote._native")
    except BaseException as exc:  # mypyc's own errors exit
        _say(f"mypyc failed ({exc!r}): pure Python")
        return []
    finally:
        os.chdir(cwd)
    return list(exts)


setup(ext_modules=_extensions(), cmdclass={"build_ext": _OptionalBuildExt})
