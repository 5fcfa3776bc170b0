"""The optional build step (``setup.py``): the hot modules compiled by mypyc where the install
could build them, their Python source where it could not, when ``GPUREMOTE_PURE=1`` asks for
it, or when a source changed after the build (``gpuremote._native``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import PythonJson

import gpuremote
import gpuremote.proxy.session
import gpuremote.xp
from gpuremote import _native

_WHICH = """
    import json
    import gpuremote.proxy.session, gpuremote.xp, gpuremote.wire.protocol as p
    from gpuremote import _native
    print(json.dumps({"build": _native.build(), "why": _native.pure_reason(),
                      "compiled": _native.compiled_modules(), "protocol": p.__file__}))
    """


def test_the_modules_the_install_compiled_are_the_ones_thatpython_json() -> None:
    """Where the install compiled the hot modules (``_native.json`` vouches for them), each
    runs compiled. ``scripts/test.sh`` sets ``GPUREMOTE_EXPECT_COMPILED=1`` where a C
    compiler is present: a build that fell back to pure Python then fails here."""
    if _native.pure_reason() is not None:
        if os.environ.get("GPUREMOTE_EXPECT_COMPILED") == "1":
            pytest.fail(f"the hot modules should run compiled here: {_native.pure_reason()}")
        pytest.skip(f"the Python source runs here: {_native.pure_reason()}")
    built = _native._COMPILED
    assert _native.build() == "compiled"
    assert _native.compiled_modules() == sorted(built)
    assert len(built) >= 10  # the wire, the session, the core, the proxy's path


def test_gpuremote_pure_runs_the_python_source(python_json: PythonJson) -> None:
    out = python_json(_WHICH, GPUREMOTE_PURE="1")
    assert out["build"] == "pure" and out["compiled"] == []
    assert str(out["protocol"]).endswith("protocol.py")
    assert out["why"] == "GPUREMOTE_PURE is set"


def test_a_source_changed_since_the_build_is_seen(tmp_path: Path) -> None:
    """The manifest's hash covers every source of the package, not only the compiled ones
    (compiled code depends on the types of what it imports): any edit changes it."""
    (tmp_path / "gpuremote" / "wire").mkdir(parents=True)
    (tmp_path / "transports").mkdir()
    (tmp_path / "gpuremote" / "wire" / "protocol.py").write_text("x = 1\n")
    (tmp_path / "transports" / "tcp.py").write_text("y = 2\n")
    before = _native.sources_digest(tmp_path)
    assert _native.sources_digest(tmp_path) == before
    (tmp_path / "transports" / "tcp.py").write_text("y = 3\n")
    assert _native.sources_digest(tmp_path) != before
    (tmp_path / "transports" / "tcp.py").write_text("y = 2\n")
    assert _native.sources_digest(tmp_path) == before
    (tmp_path / "gpuremote" / "config.py").write_text("")  # a new module counts too
    assert _native.sources_digest(tmp_path) != before


def test_an_extension_file_the_manifest_does_not_vouch_for_is_not_imported(
    python_json: PythonJson,
) -> None:
    """With the Python source asked for, every gpuremote module comes from its ``.py``,
    whatever extension files lie beside the sources (another build's, another Python's)."""
    out = python_json(
        """
        import json
        import gpuremote.proxy.session, gpuremote.xp, gpuremote.core.arrays as a
        import gpuremote.wire.protocol as p
        print(json.dumps({"files": [p.__file__, a.__file__, gpuremote.proxy.session.__file__]}))
        """,
        GPUREMOTE_PURE="1",
    )
    assert all(str(f).endswith(".py") for f in out["files"]), out  # type: ignore[union-attr]


@pytest.mark.slow
def test_both_builds_answer_alike(python_json: PythonJson) -> None:
    """The same op, compiled and pure, in two interpreters: the same bytes back."""
    program = """
        import json
        import numpy as np
        import gpuremote.xp as gx
        from gpuremote import _native

        d = gx.connect_local("numpy")
        x = gx.asarray(np.linspace(-2, 2, 33, dtype=np.float32), device=d)
        y = gx.tanh(x * 3.0) + gx.sum(x, axis=0) / 7.0 - gx.cumulative_sum(x)[::-1]
        out = np.asarray(y)
        d.close()
        print(json.dumps({"build": _native.build(), "bytes": out.tobytes().hex()}))
        """
    pure = python_json(program, GPUREMOTE_PURE="1")
    default = python_json(program)
    assert pure["build"] == "pure"
    assert default["bytes"] == pure["bytes"]
    assert gpuremote.__version__  # (the package imports in both)
