"""The allow-listed ops (one table, the standard's functions plus gpuremote's fused ones):
metadata inferred locally equals what NumPy computes where the standard agrees with it,
values equal the plain NumPy expression, and the direct (into-the-output) path equals the
general one."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gpuremote.ops import OPS, OpError, infer

rng = np.random.default_rng(0)


def arr(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return (rng.standard_normal(shape) + 2).astype(dtype)


CASES: list[tuple[str, list[np.ndarray], dict[str, Any], Callable[..., Any]]] = [
    ("add", [arr(3, 4), arr(4)], {}, np.add),
    ("subtract", [arr(3, 1), arr(1, 5)], {}, np.subtract),
    ("multiply", [arr(2, 3)], {"scalar": 2.5}, lambda x: x * np.float32(2.5)),
    ("subtract", [arr(2, 3)], {"scalar": 1, "reverse": True}, lambda x: 1 - x),
    ("divide", [arr(2, 3), arr(2, 3)], {}, np.divide),
    ("maximum", [arr(4), arr(4)], {}, np.maximum),
    ("pow", [arr(3)], {"scalar": 2}, lambda x: x**2),
    ("greater", [arr(3), arr(3)], {}, np.greater),
    ("exp", [arr(5)], {}, np.exp),
    ("log", [arr(5)], {}, np.log),
    ("tanh", [arr(2, 2)], {}, np.tanh),
    ("sqrt", [arr(3)], {}, np.sqrt),
    ("add", [np.arange(4, dtype=np.int32), arr(4)], {}, np.add),  # mixed kinds: float64
    ("multiply", [np.arange(4, dtype=np.int16)], {"scalar": 3}, lambda x: x * np.int16(3)),
    ("less", [arr(4)], {"scalar": 2.0, "reverse": True}, lambda x: np.float32(2.0) < x),
    ("relu", [arr(6) - 2], {}, lambda x: np.maximum(x, 0)),
    ("sigmoid", [arr(4)], {}, lambda x: 1 / (1 + np.exp(-x))),
    ("relu_grad", [arr(3), arr(3) - 2], {}, lambda g, x: g * (x > 0)),
    ("matmul", [arr(3, 4), arr(4, 5)], {}, np.matmul),
    ("matmul", [arr(2, 3, 4), arr(4)], {}, np.matmul),
    ("matmul", [arr(4), arr(4)], {}, np.matmul),
    ("matmul", [arr(5, 1, 2, 3), arr(4, 3, 2)], {}, np.matmul),
    ("sum", [arr(3, 4)], {"axis": 1}, lambda x: x.sum(axis=1)),
    ("sum", [arr(3, 4)], {}, np.sum),
    ("mean", [arr(3, 4)], {"axis": 0, "keepdims": True}, lambda x: x.mean(0, keepdims=True)),
    ("mean", [arr(2, 3, dtype=np.float64)], {"axis": [0, 1]}, lambda x: x.mean((0, 1))),
    ("max", [arr(3, 4)], {"axis": -1}, lambda x: x.max(-1)),
    ("permute_dims", [arr(2, 3, 4)], {"axes": [2, 1, 0]}, np.transpose),
    ("permute_dims", [arr(2, 3, 4)], {"axes": [1, 0, 2]}, lambda x: x.transpose(1, 0, 2)),
    (
        "softmax",
        [arr(3, 5)],
        {},
        lambda x: (
            np.exp(x - x.max(-1, keepdims=True))
            / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
        ),
    ),
    (
        "layer_norm",
        [arr(2, 8), arr(8), arr(8)],
        {"eps": 1e-5},
        lambda x, g, b: (
            (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
        ),
    ),
    ("axpy", [arr(4), arr(4)], {"alpha": 0.5}, lambda x, y: y + np.float32(0.5) * x),
    ("astype", [arr(3)], {"dtype": "float64"}, lambda x: x.astype(np.float64)),
    ("where", [arr(3) > 2, arr(3), arr(3)], {}, np.where),
    (
        "full",
        [],
        {"value": 3.0, "shape": [2, 2], "dtype": "float32"},
        lambda: np.full((2, 2), 3.0, np.float32),
    ),
    (
        "gelu",
        [arr(4)],
        {},
        lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    ),
]


@pytest.mark.parametrize(
    ("name", "inputs", "params", "ref"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_op_matches_numpy(
    name: str, inputs: list[np.ndarray], params: dict[str, Any], ref: Callable[..., Any]
) -> None:
    expected = np.asarray(ref(*inputs))
    ((shape, dtype),) = infer(name, [(x.shape, x.dtype) for x in inputs], params)
    assert shape == expected.shape
    assert dtype == expected.dtype
    out = np.empty(shape, dtype)
    with np.errstate(all="ignore"):
        OPS[name].run(np, inputs, [out], params)
    np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "metas", "params", "match"),
    [
        ("matmul", [((2, 3), np.dtype("f4")), ((4, 5), np.dtype("f4"))], {}, "not aligned"),
        ("add", [((2, 3), np.dtype("f4")), ((4,), np.dtype("f4"))], {}, "broadcast"),
        ("sum", [((2, 3), np.dtype("f4"))], {"axis": 5}, "out of range"),
        ("softmax", [((2, 3), np.dtype("i4"))], {}, "floating"),
        ("exp", [((2,), np.dtype("f4"))], {"bogus": 1}, "no parameter"),
        ("add", [((2,), np.dtype("f4"))], {}, "scalar param"),
        ("exp", [((2,), np.dtype("i4"))], {}, "floating-point"),
        ("mean", [((2,), np.dtype("i8"))], {}, "floating-point"),
        ("add", [((2,), np.dtype("i4"))], {"scalar": 1.5}, "floating-point"),
        ("add", [((2,), np.dtype("?")), ((2,), np.dtype("f4"))], {}, "numeric"),
        ("nope", [], {}, "unknown op"),
        ("permute_dims", [((2, 3), np.dtype("f4"))], {"axes": [0, 0]}, "permutation"),
    ],
)
def test_bad_inputs_are_op_errors(
    name: str, metas: Any, params: dict[str, Any], match: str
) -> None:
    with pytest.raises(OpError, match=match):
        infer(name, metas, params)


shapes = hnp.array_shapes(min_dims=0, max_dims=3, max_side=4)
dtypes = st.sampled_from([np.float32, np.float64, np.int32, np.int64, np.bool_])


@given(
    hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4),
    dtypes,
    dtypes,
    st.sampled_from(["add", "multiply", "maximum", "subtract", "greater"]),
)
@settings(max_examples=200, deadline=None)
def test_binary_metadata_follows_the_standard(bshapes: Any, da: Any, db: Any, name: str) -> None:
    a = np.ones(bshapes.input_shapes[0], da)
    b = np.ones(bshapes.input_shapes[1], db)
    metas = [(a.shape, a.dtype), (b.shape, b.dtype)]
    if a.dtype.kind == "b" or b.dtype.kind == "b":  # numeric functions: bool is refused
        with pytest.raises(OpError):
            infer(name, metas, {})
        return
    expected = getattr(np, name)(a, b)  # the standard's promotion is NumPy's here
    ((shape, dtype),) = infer(name, metas, {})
    assert (shape, dtype) == (expected.shape, expected.dtype)


@given(
    hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4),
    st.sampled_from([np.float32, np.float64, np.int32, np.int64]),
    st.sampled_from([np.float32, np.float64, np.int32, np.int64]),
    st.sampled_from(["add", "multiply", "maximum", "subtract", "less_equal", "not_equal"]),
    st.one_of(st.none(), st.integers(-100, 100), st.floats(-100, 100)),
    st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_direct_path_equals_the_general_one(
    bshapes: Any, da: Any, db: Any, name: str, scalar: Any, reverse: bool
) -> None:
    """Element-wise functions write straight into the output when the dtypes allow: the
    result is the one the general path (array API namespace, then a copy) computes."""
    from gpuremote.ops._base import namespace, write

    a = (np.arange(math.prod(bshapes.input_shapes[0])) % 7 - 3).astype(da)
    a = a.reshape(bshapes.input_shapes[0])
    b = (np.arange(math.prod(bshapes.input_shapes[1])) % 5 - 2).astype(db)
    b = b.reshape(bshapes.input_shapes[1])
    ins = [a, b]
    params: dict[str, Any] = {}
    if scalar is not None:
        ins, params = [a], {"scalar": scalar, "reverse": reverse}
    try:
        ((shape, dtype),) = infer(name, [(x.shape, x.dtype) for x in ins], params)
    except OpError:
        return  # e.g. a float scalar with an integer array: refused by the standard
    op = OPS[name]
    direct, general = np.empty(shape, dtype), np.empty(shape, dtype)
    op.run(np, ins, [direct], params)
    from gpuremote.ops.elementwise import OPS as ELEMENTWISE

    call = next(o for o in ELEMENTWISE if o.name == name)
    assert call is op
    write([general], _general(name, ins, params, namespace(np)))
    np.testing.assert_array_equal(direct, general)


def _general(name: str, ins: list[np.ndarray], params: dict[str, Any], ns: Any) -> Any:
    if len(ins) == 2:
        return getattr(ns, name)(ins[0], ins[1])
    s = ns.asarray(params["scalar"], dtype=ins[0].dtype)
    a, b = (s, ins[0]) if params["reverse"] else (ins[0], s)
    return getattr(ns, name)(a, b)


def test_the_table_is_the_category_modules() -> None:
    """One table: every op comes from exactly one category module's list."""
    from gpuremote import ops

    names = [op.name for m in ops.MODULES for op in m.OPS]
    assert len(names) == len(set(names)) == len(OPS)
    assert {"add", "where", "astype", "matmul", "sum", "full", "linalg.inv", "relu"} <= set(OPS)
