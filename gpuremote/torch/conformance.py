"""PyTorch's own OpInfo database run on the ``gpuremote`` device against the CPU.

PyTorch keeps, for every ATen op it ships, sample inputs and the dtypes each device supports
(``torch.testing._internal.common_methods_invocations.op_db``); it runs them on every backend
it ships. This module runs them on ``gpuremote``: each OpInfo, for each dtype asked, on its
first sample inputs, forward (and backward where the op supports autograd), once on the CPU
and once on the device, and compares the results with ``torch.testing.assert_close``'s
tolerances for the dtype. Each case ends as:

- ``equal``: every sample's results (and gradients) match the CPU's;
- ``error``: the device raised where the CPU did not (the message says which op and why);
- ``wrong``: the device gave a different answer: never acceptable;
- ``skipped``: the CPU itself refused every sample (nothing to compare).

``python -m gpuremote.torch.conformance`` runs it against a proxy in this process (or the one
at ``--url``) and prints the counts, the table per dtype (``--markdown``) and each case's
outcome (``--json``). Needs PyTorch's test helpers (``pip install expecttest``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ._tensors import DEVICE

__all__ = [
    "DTYPES",
    "Case",
    "Listed",
    "Outcome",
    "cases",
    "load_unsupported",
    "main",
    "op_db",
    "run_case",
    "unexpected",
]

#: the dtypes of the full matrix, by name
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
}
#: OpInfos whose results are uninitialised memory by contract: only their metadata compares
_UNINITIALISED = frozenset(
    {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
)


@dataclass(frozen=True)
class Case:
    """One OpInfo, one dtype, forward or backward."""

    op: Any
    dtype: torch.dtype
    mode: str  # "forward" | "backward"

    @property
    def id(self) -> str:
        """``name[.variant]:dtype:mode``: how the unsupported list names the case."""
        variant = f".{self.op.variant_test_name}" if self.op.variant_test_name else ""
        return f"{self.op.name}{variant}:{str(self.dtype).removeprefix('torch.')}:{self.mode}"


@dataclass
class Outcome:
    """What a case came to (``status``: equal, error, wrong or skipped)."""

    status: str
    detail: str = ""
    samples: int = 0


def op_db() -> list[Any]:
    """PyTorch's OpInfos (``expecttest`` must be installed: PyTorch's test helpers import it)."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db as db
    except ImportError as exc:
        raise RuntimeError(
            f"PyTorch's OpInfo database needs its test helpers: pip install expecttest ({exc})"
        ) from exc
    _no_test_case_to_find()
    return list(db)


def _no_test_case_to_find() -> None:
    """PyTorch's sample iterators look for the ``unittest.TestCase`` running them by
    crawling the stack with its source lines (``inspect.stack()``, per iterator): there is
    none here, and the crawl took two thirds of a float32 run (42 s of 62)."""
    import torch.testing._internal.common_utils as common_utils
    import torch.testing._internal.opinfo.core as opinfo_core

    def no_test_fn() -> None:
        return None

    modules: tuple[Any, ...] = (common_utils, opinfo_core)
    for module in modules:
        if hasattr(module, "extract_test_fn"):
            module.extract_test_fn = no_test_fn


def cases(
    ops: Iterable[Any],
    dtypes: Iterable[torch.dtype],
    modes: Iterable[str] = ("forward", "backward"),
) -> Iterator[Case]:
    """The cases of ``ops``: each dtype the CPU supports for it, each mode it supports."""
    dtypes, modes = list(dtypes), list(modes)
    for op in ops:
        supported = op.supported_dtypes("cpu")
        for dtype in dtypes:
            if dtype not in supported:
                continue
            for mode in modes:
                if mode == "backward" and not _differentiable(op, dtype):
                    continue
                yield Case(op, dtype, mode)


def _differentiable(op: Any, dtype: torch.dtype) -> bool:
    return bool(op.supports_autograd) and (dtype.is_floating_point or dtype.is_complex)


@dataclass(frozen=True)
class Listed:
    """A case a checked-in list expects not to end equal: ``kind`` "error" (the device
    refuses it, clearly) or "differs" (its result is not the CPU's bitwise, for ``reason``)."""

    kind: str
    reason: str


def load_unsupported(path: Path) -> dict[str, Listed]:
    """The cases a checked-in file lists: ``id [differs]  # reason`` per line."""
    out: dict[str, Listed] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        case, _, reason = text.partition("#")
        words = case.split()
        kind = "differs" if words[1:] == ["differs"] else "error"
        out[words[0]] = Listed(kind, reason.strip())
    return out


def unexpected(outcomes: dict[str, dict[str, Any]], listed: dict[str, Listed]) -> dict[str, str]:
    """The outcomes a list does not account for: a crash, an unlisted error or wrong answer,
    a case listed as an error that gives an answer, one listed as differing that raises."""
    out = {}
    for case, record in outcomes.items():
        status, entry = record["status"], listed.get(case)
        if status == "crash":
            out[case] = f"crash: {record['detail']}"
        elif status in ("error", "wrong") and entry is None:
            out[case] = f"{status}, not listed: {record['detail']}"
        elif status == "wrong" and entry is not None and entry.kind != "differs":
            out[case] = f"a wrong answer, listed as an error: {record['detail']}"
        elif status == "error" and entry is not None and entry.kind == "differs":
            out[case] = f"an error, listed as differing: {record['detail']}"
    return out


# -- running one case --------------------------------------------------------------------------
def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of device tensor ``t`` with its layout: the whole of its storage, viewed
    at its offset and strides, so that ops which read a view's storage (``as_strided``) see
    the same memory; with its conjugate and negative bits, as a leaf where ``t`` requires
    grad."""
    physical = t.resolve_conj().resolve_neg() if t.is_conj() or t.is_neg() else t
    storage = physical.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(storage, 0, [storage.nbytes()], [1])
    host = torch.empty(0, dtype=t.dtype).set_(
        raw.cpu().untyped_storage(), physical.storage_offset(), t.shape, t.stride()
    )
    if t.is_conj():
        host = host.conj()
    if t.is_neg():
        host = torch._neg_view(host)
    return host.requires_grad_(t.requires_grad) if t.requires_grad else host


def _on_cpu(x: Any) -> Any:
    """``x`` (a sample's inputs, made on the device) with each device tensor copied to the
    CPU (``_host_copy``) and the device's name replaced by ``cpu``."""

    def move(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.device.type == DEVICE:
            with torch.no_grad():
                return _host_copy(t.detach()).requires_grad_(t.requires_grad)
        if isinstance(t, torch.device) and t.type == DEVICE:
            return torch.device("cpu")
        if isinstance(t, str) and t.startswith(DEVICE):
            return "cpu"
        return t

    return pytree.tree_map(move, x)


def _call(op: Any, inputs: tuple[Any, Any, Any], seed: int) -> Any:
    torch.manual_seed(seed)
    x, args, kwargs = inputs
    return op(x, *args, **kwargs)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _compare(actual: Any, expected: Any, metadata_only: bool) -> str:
    """'' where ``actual`` (from the device) matches ``expected`` (from the CPU), else how
    they differ."""
    a_leaves = pytree.tree_leaves(actual)
    e_leaves = pytree.tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        return f"{len(a_leaves)} results, expected {len(e_leaves)}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"result {i}: a {type(a).__name__}, expected a tensor"
            if a.device.type not in (DEVICE, e.device.type):
                return f"result {i} on {a.device}, expected {DEVICE}"
            a = a.cpu() if a.device.type == DEVICE else a
            if metadata_only:
                if a.shape != e.shape or a.dtype != e.dtype:
                    return (
                        f"result {i}: {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}"
                    )
                continue
            try:
                torch.testing.assert_close(
                    a, e, equal_nan=True, check_device=False, check_layout=False
                )
            except AssertionError as exc:
                return f"result {i}: {_first_line(str(exc), 3)}"
        elif isinstance(e, float) and isinstance(a, float):
            if not (a == e or (math.isnan(a) and math.isnan(e))):
                return f"result {i}: {a!r}, expected {e!r}"
        elif isinstance(e, (torch.dtype, torch.device)):
            continue
        elif a != e:
            return f"result {i}: {a!r}, expected {e!r}"
    return ""


def _first_line(text: str, lines: int = 1) -> str:
    return " | ".join(x.strip() for x in text.strip().splitlines()[:lines] if x.strip())[:300]


def _grads(sample: Any, outputs: Any, inputs: Any, seed: int) -> list[Any] | None:
    """The gradients of ``outputs`` (after the sample's ``output_process_fn_grad``) with
    respect to the inputs that require them, for fixed random output gradients."""
    outs = [t for t in _tensors(sample.output_process_fn_grad(outputs)) if t.requires_grad]
    leaves = [t for t in _tensors(inputs) if t.requires_grad]
    if not outs or not leaves:
        return None
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for o in outs:
        g = torch.randn(o.shape, generator=gen, dtype=torch.float64)
        g = g.to(o.dtype) if not o.dtype.is_complex else torch.complex(g, g).to(o.dtype)
        grads.append(g.to(o.device))
    return list(torch.autograd.grad(outs, leaves, grads, allow_unused=True))


def run_case(case: Case, samples: int = 3, seed: int = 0) -> Outcome:
    """Run ``case`` on its first ``samples`` sample inputs (see the module docstring). The
    samples are made for the device, as PyTorch makes them for each device it tests
    (arguments that must stay on the CPU stay there); the CPU runs copies of them."""
    op, dtype = case.op, case.dtype
    backward = case.mode == "backward"
    metadata_only = op.name in _UNINITIALISED
    compared = 0
    torch.manual_seed(seed)
    try:
        iterator = iter(op.sample_inputs(DEVICE, dtype, requires_grad=backward))
    except Exception as exc:
        return Outcome("error", f"making samples: {type(exc).__name__}: {_first_line(str(exc))}")
    for k in range(samples):
        try:
            sample = next(iterator)
            device_inputs = (sample.input, sample.args, sample.kwargs)
            cpu_inputs = _on_cpu(device_inputs)
        except StopIteration:
            break
        except Exception as exc:
            return Outcome(
                "error", f"making sample {k}: {type(exc).__name__}: {_first_line(str(exc))}"
            )
        try:
            expected = _call(op, cpu_inputs, seed + k)
            expected_grads = _grads(sample, expected, cpu_inputs, seed + k) if backward else None
        except Exception:
            continue  # the CPU refuses this sample: nothing to compare
        try:
            actual = _call(op, device_inputs, seed + k)
            actual_grads = _grads(sample, actual, device_inputs, seed + k) if backward else None
            diff = _compare(actual_grads, expected_grads, metadata_only) if backward else ""
            diff = _compare(actual, expected, metadata_only) or diff
        except Exception as exc:
            return Outcome(
                "error", f"sample {k}: {type(exc).__name__}: {_first_line(str(exc))}", compared
            )
        if diff:
            return Outcome("wrong", f"sample {k}: {diff}", compared)
        compared += 1
    if not compared:
        return Outcome("skipped", "the CPU refused every sample", 0)
    return Outcome("equal", "", compared)


# -- the command line ----------------------------------------------------------------------------
def _table(rows: dict[str, Counter[str]]) -> str:
    head = "| dtype, mode | cases | equal | not supported | wrong | skipped | equal % |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for key, c in rows.items():
        ran = c["equal"] + c["error"] + c["wrong"]
        pct = 100.0 * c["equal"] / ran if ran else 0.0
        lines.append(
            f"| {key} | {sum(c.values())} | {c['equal']} | {c['error']} | {c['wrong']} "
            f"| {c['skipped']} | {pct:.1f} |"
        )
    return "\n".join(lines)


def _run_isolated(ids: list[str], argv: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Run the cases ``ids`` in a child process (``--worker``), restarting it after a case
    that kills it (which is reported as ``crash``)."""
    import subprocess

    left = list(ids)
    while left:
        child = subprocess.Popen(
            [sys.executable, "-m", "gpuremote.torch.conformance", *argv, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("\n".join(left) + "\n")
        child.stdin.close()
        for line in child.stdout:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            case_id = record.pop("id")
            left.remove(case_id)
            yield case_id, record
        code = child.wait()
        if left:  # the child died in the next case
            yield left.pop(0), {"status": "crash", "detail": f"the process died (exit {code})"}


def _run_sharded(
    ids: list[str], argv: list[str], jobs: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``_run_isolated`` in ``jobs`` child processes at once, each on every ``jobs``-th case
    (the cases are independent: each compares one op on its own inputs with the CPU)."""
    if jobs <= 1:
        yield from _run_isolated(ids, argv)
        return
    import queue
    import threading

    results: queue.Queue[tuple[str, dict[str, Any]] | BaseException | None] = queue.Queue()

    def shard(part: list[str]) -> None:
        try:
            for item in _run_isolated(part, argv):
                results.put(item)
        except BaseException as exc:  # the parent raises it
            results.put(exc)
        finally:
            results.put(None)

    for i in range(jobs):
        threading.Thread(target=shard, args=(ids[i::jobs],), daemon=True).start()
    running = jobs
    while running:
        item = results.get()
        if item is None:
            running -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield item


def main(argv: list[str] | None = None) -> int:
    """``python -m gpuremote.torch.conformance``: see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m gpuremote.torch.conformance")
    parser.add_argument("--url", help="a proxy's URL (default: one in this process, NumPy)")
    parser.add_argument("--backend", default="numpy", help="the in-process proxy's backend")
    parser.add_argument("--dtypes", default="float32", help="comma-separated, or 'all'")
    parser.add_argument("--modes", default="forward,backward")
    parser.add_argument("--samples", type=int, default=3, help="sample inputs per case")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default all)")
    parser.add_argument("--skip", default="", help="comma-separated OpInfo names to leave out")
    parser.add_argument("--json", type=Path, help="write each case's outcome here")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument(
        "--expected",
        type=Path,
        help="a list of the cases not expected equal (tests/torch_opinfo_unsupported.txt): "
        "exit 1 on any outcome it does not account for",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="run the cases in a child process, restarted after one that kills it",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="with --isolate: child processes at once"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    names = list(DTYPES) if args.dtypes == "all" else args.dtypes.split(",")
    dtypes = [DTYPES[n] for n in names]
    wanted = {n for n in args.ops.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    ops = [o for o in op_db() if (not wanted or o.name in wanted) and o.name not in skip]
    all_cases = list(cases(ops, dtypes, args.modes.split(",")))
    started = time.perf_counter()
    if args.isolate and not args.worker:
        child_argv = [a for a in argv if a != "--isolate"]
        outcomes: Iterable[tuple[str, dict[str, Any]]] = _run_sharded(
            [c.id for c in all_cases], _without_output(child_argv), args.jobs
        )
        by_id = {c.id: c for c in all_cases}
        keyed: Iterator[tuple[Case, dict[str, Any]]] = ((by_id[i], r) for i, r in outcomes)
    else:
        keyed = _run_here(
            all_cases, args, {line.strip() for line in sys.stdin} if args.worker else None
        )
    rows: dict[str, Counter[str]] = {}
    results: dict[str, dict[str, Any]] = {}
    for case, record in keyed:
        if args.worker:
            print(json.dumps({"id": case.id, **record}), flush=True)
            continue
        key = f"{str(case.dtype).removeprefix('torch.')}, {case.mode}"
        rows.setdefault(key, Counter())[record["status"]] += 1
        results[case.id] = record
        if record["status"] in ("error", "wrong", "crash"):
            print(f"{record['status']:6} {case.id}: {record['detail']}", file=sys.stderr)
    if args.worker:
        return 0
    print(_table(rows) if args.markdown else "\n".join(f"{k}: {dict(v)}" for k, v in rows.items()))
    print(f"{len(results)} cases in {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if args.expected is not None:
        surprises = unexpected(results, load_unsupported(args.expected))
        for case_id, why in sorted(surprises.items()):
            print(f"unexpected {case_id}: {why}", file=sys.stderr)
        return 1 if surprises else 0
    return 1 if any(c["wrong"] or c["crash"] for c in rows.values()) else 0


def _without_output(argv: list[str]) -> list[str]:
    """The child's arguments: the parent's, without what only the parent does (writing the
    outcomes, the table, checking them against a list, starting the children)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--expected", "--jobs"):
            skip = True
        elif a != "--markdown" and not a.startswith(("--json=", "--expected=", "--jobs=")):
            out.append(a)
    return out


def _run_here(
    all_cases: list[Case], args: argparse.Namespace, only: set[str] | None
) -> Iterator[tuple[Case, dict[str, Any]]]:
    import gpuremote.torch as gt

    conn = gt.connect(args.url) if args.url else gt.connect_local(args.backend)
    with conn:
        for case in all_cases:
            if only is not None and case.id not in only:
                continue
            outcome = run_case(case, args.samples)
            yield case, {"status": outcome.status, "detail": outcome.detail}


if __name__ == "__main__":
    sys.exit(main())
