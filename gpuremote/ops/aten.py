"""The ATen ops a proxy runs for ``gpuremote.torch``: a table per torch release, checked in
(``gpuremote/ops/aten/torch-2.13.tsv``: one op a line, why it is allowed, its schema) and
reviewed in diffs, so that what a proxy runs is written down, not derived at run time.

The table is made by the rules below from the release's own op registry: an op is allowed
when it computes on tensors and plain values only (every argument a tensor, a number, a
dtype, a memory format or a string: no storage, stream, file name or host pointer), returns
tensors or numbers that are not views (views are metadata, made by the client), and its name
says nothing of what reaches outside a tensor's memory (``set_``, ``as_strided``, ``resize``,
``from_file``, ...) or hands out uninitialised memory (``empty``: the client makes empty
tensors by ``alloc``, which zeroes). A proxy runs an op only if its release's table lists it
with the schema it has (``allowed``); any other is refused, naming it.

    python -m gpuremote.ops.aten            # what this torch release adds to or drops from
                                            # its table (exit 1 if anything)
    python -m gpuremote.ops.aten --write    # write this release's table

Also the one place an op's result is split into one value per return of its schema
(``returns``), for the client and the proxy.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["ALLOWED_DIR", "Allowed", "allowed", "generate", "release", "returns", "table_path"]

#: where the tables are, one per torch release
ALLOWED_DIR = Path(__file__).with_name("aten")

#: the types an allowed op's arguments may have (``str(argument.type)``)
ARGUMENT_TYPES = frozenset(
    {
        "Tensor",
        "Optional[Tensor]",
        "List[Tensor]",
        "List[Optional[Tensor]]",
        "int",
        "Optional[int]",
        "List[int]",
        "Optional[List[int]]",
        "SymInt",
        "Optional[SymInt]",
        "List[SymInt]",
        "Optional[List[SymInt]]",
        "float",
        "Optional[float]",
        "List[float]",
        "Optional[List[float]]",
        "bool",
        "Optional[bool]",
        "List[bool]",
        "number",
        "Optional[number]",
        "List[number]",
        "ScalarType",
        "Optional[ScalarType]",
        "Optional[Layout]",
        "Optional[Device]",
        "Optional[MemoryFormat]",
        "str",
        "Optional[str]",
        "Optional[Generator]",
    }
)
#: the types an allowed op's results may have
RESULT_TYPES = frozenset({"Tensor", "List[Tensor]", "int", "float", "bool", "number"})
#: parts of the names of the ops that reach beyond a tensor's memory or out of the process,
#: or that hand out memory nobody wrote
DENIED = (
    "as_strided",
    "set_",
    "resize",
    "storage",
    "from_file",
    "pin_memory",
    "record_stream",
    "_nested",
    "sparse",
    "mkldnn",
    "cudnn",
    "miopen",
    "fbgemm",
    "_debug",
    "_print",
    "_assert",
    "_make_per",
    "lift",
    "_use_",
    "data_ptr",
    "empty",
)


class Allowed(NamedTuple):
    """A line of a table: the op (``packet.overload``), why it is allowed, its schema."""

    name: str
    why: str
    schema: str


def release(torch: Any) -> str:
    """The release a table is for: ``major.minor`` of ``torch.__version__``."""
    return ".".join(str(torch.__version__).split("+")[0].split(".")[:2])


def table_path(version: str) -> Path:
    return ALLOWED_DIR / f"torch-{version}.tsv"


def _why(op: Any) -> str | None:
    """Why ``op`` is allowed (None: it is not), by the rules of the module docstring."""
    schema = op._schema
    packet = schema.name.split("::", 1)[1]
    if any(d in packet for d in DENIED):
        return None
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return None  # a view
    if any(str(a.type) not in ARGUMENT_TYPES for a in schema.arguments):
        return None
    if any(str(r.type) not in RESULT_TYPES for r in schema.returns):
        return None
    parts = []
    if any(a.is_out for a in schema.arguments):
        parts.append("writes its out= tensors")
    elif any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        parts.append("writes its operands in place")
    if any(r.alias_info is None and "Tensor" in str(r.type) for r in schema.returns):
        parts.append("makes new tensors")
    if any("Tensor" not in str(r.type) for r in schema.returns):
        parts.append("answers a number")
    if not schema.returns:
        parts.append("returns nothing")
    return "; ".join(parts) or "computes on tensors"


def generate(torch: Any) -> list[Allowed]:
    """The table of the running torch release, by the rules (sorted by op)."""
    rows = []
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::"):
            continue
        packet_name, _, overload = full.removeprefix("aten::").partition(".")
        op = getattr(getattr(torch.ops.aten, packet_name), overload or "default")
        why = _why(op)
        if why is not None:
            rows.append(Allowed(f"{packet_name}.{overload or 'default'}", why, str(op._schema)))
    return sorted(rows)


def read(path: Path) -> dict[str, Allowed]:
    """A table file's lines by op (``ValueError`` on a line that is not one)."""
    rows: dict[str, Allowed] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 3 or fields[0] in rows:
            raise ValueError(f"{path}:{n}: not an op, why and schema (or the op twice)")
        rows[fields[0]] = Allowed(*fields)
    return rows


def write(path: Path, rows: list[Allowed], version: str) -> None:
    head = (
        f"# the ATen ops a proxy runs with torch {version}: op, why allowed, schema "
        "(made by python -m gpuremote.ops.aten --write; the rules: gpuremote/ops/aten.py)\n"
    )
    path.write_text(head + "".join(f"{r.name}\t{r.why}\t{r.schema}\n" for r in rows))


@functools.cache
def allowed(version: str) -> dict[str, Allowed]:
    """The ops the table of torch release ``version`` allows (empty: there is no table)."""
    path = table_path(version)
    return read(path) if path.is_file() else {}


def returns(result: Any, n: int) -> tuple[Any, ...]:
    """An op's result as one value per return of its schema (``n`` of them)."""
    if n == 1:
        return (result,)
    return () if n == 0 else tuple(result)


def main(argv: list[str] | None = None) -> int:
    """``python -m gpuremote.ops.aten``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m gpuremote.ops.aten")
    parser.add_argument("--write", action="store_true", help="write this release's table")
    args = parser.parse_args(argv)
    import torch

    version = release(torch)
    rows = generate(torch)
    path = table_path(version)
    if args.write:
        write(path, rows, version)
        print(f"{path}: {len(rows)} ops")
        return 0
    checked_in = read(path) if path.is_file() else {}
    made = {r.name: r for r in rows}
    added = sorted(made.keys() - checked_in.keys())
    dropped = sorted(checked_in.keys() - made.keys())
    changed = sorted(k for k in made.keys() & checked_in.keys() if made[k] != checked_in[k])
    for title, names in (("adds", added), ("drops", dropped), ("changes", changed)):
        for name in names:
            print(f"torch {version} {title} {name}: {(made.get(name) or checked_in[name]).schema}")
    if not path.is_file():
        print(f"no table for torch {version} yet: python -m gpuremote.ops.aten --write")
    print(f"{len(rows)} ops allowed by the rules; the table at {path} has {len(checked_in)}")
    return 1 if added or dropped or changed or not path.is_file() else 0


if __name__ == "__main__":
    sys.exit(main())
