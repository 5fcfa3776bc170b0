"""The optional build step (``setup.py``): the hot modules compiled by mypyc where the install
could build them, their Python source where it could not, when ``GPUREMOTE_PURE=1`` asks for
it, or when a source changed after the build (``gpuremote._native``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

import gpuremote
import gpuremote.proxy.session
import gpuremote.xp
from gpuremote import _native


def _run(program: str, **env: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(program)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return out


_WHICH = """
    import json
    import gpuremote.proxy.session, gpuremote.xp, gpuremote.wire.protocol as p
    from gpuremote import _native
    print(json.dumps({"build": _native.build(), "why": _native.pure_reason(),
                      "compiled": _native.compiled_modules(), "protocol": p.__file__}))
    """


def test_the_modules_the_install_compiled_are_the_ones_that_run() -> None:
    """Where the install compiled the hot modules (``_native.json`` lists them), each runs
    compiled; the set-up script compiles them wherever mypyc and a C compiler are present."""
    built = _native._built()
    if not built:
        pytest.skip(f"this install runs pure Python: {_native.pure_reason()}")
    if _native.pure_reason() is not None:
        pytest.skip(f"the Python source runs here: {_native.pure_reason()}")
    assert _native.build() == "compiled"
    assert _native.compiled_modules() == sorted(built)
    assert len(built) >= 10  # the wire, the session, the core, the proxy's path


def test_gpuremote_pure_runs_the_python_source() -> None:
    out = _run(_WHICH, GPUREMOTE_PURE="1")
    assert out["build"] == "pure" and out["compiled"] == []
    assert str(out["protocol"]).endswith("protocol.py")
    if _native._built():
        assert out["why"] == "GPUREMOTE_PURE is set"


def test_a_source_changed_since_the_build_is_seen() -> None:
    """An editable install's source edited after the build: that module's hash differs (the
    Python source then runs, with a warning, until the next build)."""
    name = "gpuremote.wire.limits"
    real = hashlib.sha256(_native._source(name).read_bytes()).hexdigest()
    assert _native._changed({name: real}) == []
    assert _native._changed({name: "0" * 64}) == [name]
    assert _native._changed({"gpuremote.no_such_module": "0" * 64}) == []  # no source: kept


def test_both_builds_answer_alike() -> None:
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
    pure = _run(program, GPUREMOTE_PURE="1")
    default = _run(program)
    assert pure["build"] == "pure"
    assert default["bytes"] == pure["bytes"]
    assert gpuremote.__version__  # (the package imports in both)
