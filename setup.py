"""The optional build step: gpuremote's hot modules compiled to C extensions by mypyc, as the
projects that ship mypyc builds do it (setuptools' ordinary ``ext_modules``).

Everything else about the package is in ``pyproject.toml``. A wheel and ``pip install .``
compile the modules of ``gpuremote._build.HOT`` where mypyc and a C compiler are present; where
they are not, or the C does not build, the install is pure Python (with a warning, never an
error): the ``.py`` is always the fallback. An editable install (``pip install -e .``) runs
the sources, so that an edit takes effect at once; ``GPUREMOTE_COMPILE_EDITABLE=1`` compiles
it in place too (``gpuremote`` then warns at import about a compiled module older than its
source). ``GPUREMOTE_COMPILE=0`` builds pure Python on purpose.

mypyc runs only when extensions are built: the metadata steps and editable installs pay
nothing for it.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _hot() -> list[str]:
    """``gpuremote._build.HOT``, read from its source (``gpuremote`` cannot be imported here:
    its dependencies may not be installed yet), as paths."""
    tree = ast.parse((HERE / "gpuremote" / "_build.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "HOT":
            names = ast.literal_eval(node.value)
            return [name.replace(".", "/") + ".py" for name in names]
    raise RuntimeError("gpuremote/_build.py defines no HOT")


def _say(msg: str) -> None:
    print(f"gpuremote build: {msg}", file=sys.stderr)


def _why_pure() -> str | None:
    """Why the modules cannot be compiled here (None: they can)."""
    if os.environ.get("GPUREMOTE_COMPILE", "1") == "0":
        return "GPUREMOTE_COMPILE=0"
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        return "mypyc is not installed"
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return "no C compiler"
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        return "no Python headers"
    return None


@functools.cache
def _mypyc_extensions() -> list[Any]:
    """The compiled modules' extensions (mypyc writes their C once: setuptools sets up
    ``build_ext`` more than once in a build)."""
    from mypyc.build import mypycify

    _say(f"compiling {len(_hot())} modules with mypyc (a minute or two)")
    cwd = os.getcwd()
    os.chdir(HERE)  # mypyc takes the modules' paths relative to the project
    try:
        return list(mypycify(_hot(), opt_level="3", group_name="gpuremote._compiled"))
    finally:
        os.chdir(cwd)


class BuildExt(build_ext):
    """``build_ext`` of the compiled hot modules: made by mypyc when the command runs (the
    placeholder extension stands for them until then: the metadata steps that set the command
    up do not run mypyc), optional (a failure leaves pure Python, and says so), and none for
    an editable install unless ``GPUREMOTE_COMPILE_EDITABLE=1``."""

    built = False

    def run(self) -> None:
        self.extensions = self._extensions()
        for ext in self.extensions:  # what setuptools' finalize_options does for each
            ext._full_name = self.get_ext_fullname(ext.name)
            ext._links_to_dynamic = ext._needs_stub = False
            ext._file_name = self.get_ext_filename(ext._full_name)
            self.ext_map[ext._full_name] = self.ext_map[ext._full_name.split(".")[-1]] = ext
        try:
            super().run()
        except Exception as exc:  # CompileError, LinkError, a missing header...
            _say(f"the compiled modules did not build ({exc!r}): pure Python")
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            self.extensions = []
            return
        self.built = bool(self.extensions)

    def _extensions(self) -> list[Any]:
        if self.editable_mode and os.environ.get("GPUREMOTE_COMPILE_EDITABLE") != "1":
            _say("an editable install runs the sources (GPUREMOTE_COMPILE_EDITABLE=1 compiles)")
            _remove_compiled_in_place()
            return []
        why = _why_pure()
        if why is not None:
            _say(f"{why}: pure Python")
            return []
        try:
            return _mypyc_extensions()
        except (Exception, SystemExit) as exc:  # mypyc's own errors exit
            _say(f"mypyc failed ({exc!r}): pure Python")
            return []

    def get_outputs(self) -> list[str]:
        return super().get_outputs() if self.built else []

    def get_output_mapping(self) -> dict[str, str]:
        return super().get_output_mapping() if self.built else {}


def _remove_compiled_in_place() -> None:
    """The compiled files an earlier build put beside the sources (each hot module's, and
    their group's, by name): Python would import them before the sources."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    names = [path.removesuffix(".py") for path in _hot()]
    names += ["gpuremote/_compiled__mypyc", "gpuremote/_native__mypyc"]  # the group, both names
    for name in names:
        (HERE / f"{name}{suffix}").unlink(missing_ok=True)


setup(
    # one placeholder: the wheel is a platform's, and build_ext runs (which makes the real
    # extensions, or none)
    ext_modules=[Extension("gpuremote._compiled", sources=[])],
    cmdclass={"build_ext": BuildExt},
)
