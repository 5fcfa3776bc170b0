"""PyTorch's own OpInfo database on the ``gpuremote`` device against the CPU
(``gpuremote.torch.conformance``): every OpInfo with float32 on the CPU, forward and, where
it supports autograd, backward, on its first three sample inputs.

Each case must end equal to the CPU, or, if ``torch_opinfo_unsupported.txt`` lists it (with
the reason), in a clear error; never a wrong answer, never a dead process. The cases run in
a child process (``--isolate``), so that a crash is reported as one instead of ending the
suite. The full matrix (float64, bfloat16, float16, int64, bool): ``python -m
gpuremote.torch.conformance --dtypes all --isolate --markdown`` (the PyTorch guide's table).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="PyTorch's OpInfos need its test helpers: expecttest")

from gpuremote.torch.conformance import load_unsupported, unexpected

pytestmark = pytest.mark.slow

UNSUPPORTED = Path(__file__).with_name("torch_opinfo_unsupported.txt")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each float32 case's outcome: ``{"status": ..., "detail": ...}`` by case id."""
    out = tmp_path_factory.mktemp("opinfo") / "float32.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuremote.torch.conformance",
            "--isolate",
            "--jobs",
            "2",  # (CI's two cores: the suite waits meanwhile)
            "--dtypes",
            "float32",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), run.stdout + run.stderr
    outcomes: dict[str, dict[str, Any]] = json.loads(out.read_text())
    print(run.stdout)
    return outcomes


def _float32(unsupported: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in unsupported.items() if ":float32:" in k}


def _with(outcomes: dict[str, dict[str, Any]], *status: str) -> dict[str, str]:
    return {k: v["detail"] for k, v in outcomes.items() if v["status"] in status}


def test_no_op_kills_the_process(outcomes: dict[str, dict[str, Any]]) -> None:
    assert not _with(outcomes, "crash"), _with(outcomes, "crash")


def test_every_outcome_but_equal_is_listed_with_its_reason(
    outcomes: dict[str, dict[str, Any]],
) -> None:
    """No wrong answer: every case that is not equal is an error the list names (or a
    difference it explains); none the list calls an error gives an answer."""
    surprises = unexpected(outcomes, load_unsupported(UNSUPPORTED))
    assert not surprises, surprises


def test_the_list_of_unsupported_ops_is_not_stale(outcomes: dict[str, dict[str, Any]]) -> None:
    """A listed case that runs equal now comes off the list (and every entry says why)."""
    listed = _float32(load_unsupported(UNSUPPORTED))
    assert all(v.reason for v in listed.values()), [k for k, v in listed.items() if not v.reason]
    equal_now = [k for k in listed if outcomes.get(k, {}).get("status") == "equal"]
    unknown = [k for k in listed if k not in outcomes]
    assert not equal_now and not unknown, (equal_now, unknown)


def test_coverage(outcomes: dict[str, dict[str, Any]]) -> None:
    """At least 95% of the float32 OpInfos equal forward, 90% backward (of those whose
    samples the CPU runs)."""
    counts: dict[str, Counter[str]] = {"forward": Counter(), "backward": Counter()}
    for case, outcome in outcomes.items():
        counts[case.rsplit(":", 1)[1]][outcome["status"]] += 1
    for mode, least in (("forward", 0.95), ("backward", 0.90)):
        c = counts[mode]
        ran = c["equal"] + c["error"] + c["wrong"] + c["crash"]
        print(f"float32 {mode}: {dict(c)}")
        assert ran > 400 and c["equal"] / ran >= least, (mode, dict(c))
