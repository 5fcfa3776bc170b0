"""The array API standard's own test suite (data-apis/array-api-tests, vendored unmodified in
``vendor/array-api-tests``) against ``gpuremote.xp`` over inproc://, with a short profile.

The xfails file lists the tests that fail and why: each is one the reference implementation
(array-api-strict) fails as well, except where the file says otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "vendor" / "array-api-tests"
XFAILS = Path(__file__).with_name("array_api_xfails.txt")
EXAMPLES = int(os.environ.get("GPUREMOTE_ARRAY_API_EXAMPLES", "3"))

XDIST = importlib.util.find_spec("xdist") is not None  # pytest-xdist (the [test] extra)

pytestmark = pytest.mark.skipif(not SUITE.is_dir(), reason=f"the suite is not at {SUITE}")


@pytest.mark.slow
def test_the_array_api_test_suite_passes(tmp_path: Path) -> None:
    pytest.importorskip("ndindex", reason="the suite needs ndindex (the [test] extra)")
    pytest.importorskip("pytest_jsonreport", reason="the suite needs pytest-json-report")
    work = tmp_path / "array-api-tests"
    shutil.copytree(SUITE, work)  # it writes its own caches: keep the repository clean
    env = dict(os.environ)
    env.pop("GPUREMOTE_URL", None)
    env["ARRAY_API_TESTS_VERSION"] = "2024.12"
    env["ARRAY_API_TESTS_MODULE"] = "exec('import gpuremote.xp as xp; xp.connect_local(\"numpy\")')"
    out = subprocess.run(
        [
            sys.executable, "-m", "pytest", "array_api_tests", "-q", "-p", "no:cacheprovider",
            f"--max-examples={EXAMPLES}", "--derandomize", "--hypothesis-disable-deadline",
            *(["-n", "2"] if XDIST else []),  # (CI's two cores: the suite waits meanwhile)
            "--xfails-file", str(XFAILS), "-W", "ignore::DeprecationWarning",
        ],
        cwd=work, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    tail = "\n".join(out.stdout.splitlines()[-40:])
    assert out.returncode == 0, f"{tail}\n{out.stderr[-2000:]}"
    assert " passed" in tail
