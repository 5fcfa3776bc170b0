"""The compiled build (``setup.py``, ``gpuremote._build``): a wheel and ``pip install .`` run
the hot modules compiled by mypyc where a C compiler is present; an editable install runs
their sources, so that an edit takes effect at once; nothing of gpuremote's changes how
Python finds modules.

``scripts/test.sh`` runs these (and the hot path's tests) twice: on the editable install, and
on a wheel it builds (``GPUREMOTE_EXPECT_COMPILED=1``, where a C compiler is present)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import PythonJson

import gpuremote
import gpuremote.proxy.session
import gpuremote.xp
from gpuremote import _build

_EXPECT_COMPILED = os.environ.get("GPUREMOTE_EXPECT_COMPILED") == "1"
_SOURCE_TREE = (Path(_build.__file__).resolve().parent.parent / "setup.py").is_file()


def test_the_build_that_runs_is_the_one_the_install_made() -> None:
    """A wheel built where a C compiler is present runs every hot module compiled; an
    editable install runs their sources (``gpuremote --version`` says which)."""
    imported = sorted(n for n in _build.HOT if n in sys.modules)
    assert len(imported) >= 10  # the wire, the session, the core, the proxy's path
    if _EXPECT_COMPILED:
        assert _build.build() == "compiled"
        assert _build.compiled_modules() == imported
    elif _SOURCE_TREE and os.environ.get("GPUREMOTE_COMPILE_EDITABLE") != "1":
        assert _build.build() == "pure" and _build.compiled_modules() == []
        files = [sys.modules[n].__file__ for n in imported]
        assert all(str(f).endswith(".py") for f in files), files


def test_importing_gpuremote_changes_no_import_machinery(python_json: PythonJson) -> None:
    """No finder of gpuremote's on ``sys.meta_path``, no hashing of sources at import."""
    out = python_json(
        """
        import json, sys
        before = [type(f).__module__ for f in sys.meta_path]
        import gpuremote, gpuremote.xp, gpuremote.proxy.session
        after = [type(f).__module__ for f in sys.meta_path]
        print(json.dumps({"before": before, "after": after}))
        """
    )
    assert out["before"] == out["after"]
    assert not [m for m in out["after"] if "gpuremote" in m]


def test_a_compiled_module_older_than_its_source_is_said_at_import(tmp_path: Path) -> None:
    """Where compiled modules sit in a source tree (an editable install compiled in place,
    ``GPUREMOTE_COMPILE_EDITABLE=1``), an edited source makes its module stale: one ``stat``
    per hot module finds it, and ``check`` warns, naming it."""
    suffix = _build._SUFFIX
    (tmp_path / "setup.py").write_text("")
    wire = tmp_path / "gpuremote" / "wire"
    wire.mkdir(parents=True)
    for name in ("protocol", "framing"):
        (wire / f"{name}.py").write_text("x = 1\n")
        (wire / f"{name}{suffix}").write_bytes(b"")
        os.utime(wire / f"{name}.py", (1000, 1000))
        os.utime(wire / f"{name}{suffix}", (2000, 2000))
    assert _build.stale_modules(tmp_path) == []
    os.utime(wire / "framing.py", (3000, 3000))  # edited after the build
    assert _build.stale_modules(tmp_path) == ["gpuremote.wire.framing"]
    installed = tmp_path / "site"  # an installed wheel: its sources do not change
    (installed / "gpuremote").mkdir(parents=True)
    assert _build.stale_modules(installed) == []


@pytest.mark.skipif(_EXPECT_COMPILED, reason="edits the sources of an editable install")
def test_an_edited_hot_module_runs_its_new_source(python_json: PythonJson, tmp_path: Path) -> None:
    """An editable install runs the tree's sources: an edit to a hot module is what runs
    next. Here in a copy of the tree, put where the install's own finder would look (that
    finder set aside): nothing of gpuremote's stands between Python and the edited source."""
    import shutil

    root = Path(_build.__file__).resolve().parent.parent
    for folder in ("gpuremote", "transports", "bench"):
        shutil.copytree(root / folder, tmp_path / folder, ignore=_no_compiled)
    (tmp_path / "gpuremote" / "transports").symlink_to(tmp_path / "transports")
    (tmp_path / "gpuremote" / "bench").symlink_to(tmp_path / "bench")
    limits = tmp_path / "gpuremote" / "wire" / "limits.py"
    limits.write_text(limits.read_text() + "\nEDITED = 'yes'\n")
    out = python_json(
        f"""
        import json, sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(f)]
        sys.path.insert(0, {str(tmp_path)!r})
        import gpuremote
        from gpuremote import _build
        from gpuremote.wire import limits
        print(json.dumps({{"edited": limits.EDITED, "build": _build.build(),
                           "file": limits.__file__}}))
        """
    )
    assert out["edited"] == "yes" and out["build"] == "pure"
    assert out["file"] == str(limits)


def _no_compiled(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n.endswith((".so", ".pyd")) or n == "__pycache__"]


def test_the_version_names_the_build(python_json: PythonJson) -> None:
    out = python_json(
        """
        import json
        from gpuremote.cli import _version
        from gpuremote import _build
        print(json.dumps({"version": _version(), "build": _build.build()}))
        """
    )
    assert out["version"].endswith(f"(hot path: {out['build']})")
    assert gpuremote.__version__ in out["version"]
