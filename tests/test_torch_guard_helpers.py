"""The guard library's C helpers for the eager path (``gpuremote/torch/_guard.cpp``), each
against the Python it stands for: ``quick`` (an op's template signature) gives
``_encoding._quick``'s appends for any argument, ``new_tensor`` makes the tensor and the
storage ``_tensors.new_tensor``'s Python path makes, freed the same way when it dies, and
``call`` (an eager op's call by template, whole) posts what ``Dispatcher._by_template``
posts, and misses where it would."""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="the device needs the [torch] extra")

import gpuremote.torch as gt  # noqa: E402
from gpuremote.torch import _encoding, _guard, _tensors  # noqa: E402


@pytest.fixture(scope="module")
def device() -> Iterator[None]:
    conn = gt.connect_local("numpy")
    if _guard.native_quick() is None:
        conn.close()
        pytest.skip(f"the guard library is not loaded: {_guard.why_not()}")
    try:
        yield
    finally:
        conn.close()


def _tensors_to_pass() -> list[Any]:
    x = torch.arange(24.0, device="gpuremote").view(4, 6)
    z = torch.ones(3, dtype=torch.complex64, device="gpuremote")
    return [
        x,
        x.t(),
        x[1:, 2:],
        x[:, 0],
        x.to(torch.float16),
        x.to(torch.int64).view(2, 12),
        torch.empty(0, 5, device="gpuremote"),
        torch.tensor(3.0, device="gpuremote"),
        z,
        z.conj(),  # a lazy bit: not taken
        torch.ones(2),  # a CPU tensor: not taken
        torch.nn.Parameter(torch.ones(2, device="gpuremote")),
    ]


_SCALARS = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.booleans(),
    st.sampled_from(["mean", "", "[", "]"]),
    st.sampled_from([torch.float32, torch.int8, torch.bool]),
    st.sampled_from([torch.contiguous_format, torch.channels_last, torch.preserve_format]),
    st.sampled_from([torch.strided, torch.sparse_coo]),
    st.sampled_from([1 + 2j, torch.device("cpu"), object(), b"x", torch.strided]),
)


def _values() -> st.SearchStrategy[Any]:
    leaf = st.one_of(_SCALARS, st.integers(0, 11).map(lambda i: ("tensor", i)))
    return st.recursive(
        leaf,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner)),
        max_leaves=12,
    )


def _resolve(value: Any, tensors: list[Any]) -> Any:
    if type(value) is tuple and len(value) == 2 and value[0] == "tensor":
        return tensors[value[1]]
    if type(value) in (list, tuple):
        return type(value)(_resolve(v, tensors) for v in value)
    return value


def _same(a: list[Any], b: list[Any]) -> bool:
    """Equal, a NaN equal to a NaN (a float's value in ``floats``)."""
    return len(a) == len(b) and all(
        x == y or (type(x) is float and type(y) is float and math.isnan(x) and math.isnan(y))
        for x, y in zip(a, b, strict=True)
    )


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_values(), max_size=5), matter=st.booleans())
def test_native_quick_appends_what_pythons_does(
    device: None, values: list[Any], matter: bool
) -> None:
    """For any arguments (numbers, NaN, bools, strings, dtypes, tensors of any layout on the
    device or not, lists and tuples of these, values of other kinds): the same answer, and
    where it is yes, the same signature (equal, of equal hash), places and floats."""
    args = tuple(_resolve(v, _tensors_to_pass()) for v in values)
    out = []
    for quick in (_guard.native_quick(), _encoding._quick):
        sig: list[Any] = []
        places: list[Any] = []
        floats: list[float] = []
        ok = quick(args, sig, places, floats, matter)
        out.append((ok, tuple(sig), places, floats))
    (ok, sig, places, floats), (ok_py, sig_py, places_py, floats_py) = out
    assert ok is ok_py
    if ok:
        assert sig == sig_py and hash(sig) == hash(sig_py)
        assert places == places_py and _same(floats, floats_py)


def test_native_quick_refuses_what_is_not_a_list_of_arguments(device: None) -> None:
    quick = _guard.native_quick()
    with pytest.raises(TypeError, match="quick"):
        quick({1, 2}, [], [], [], True)
    with pytest.raises(TypeError, match="quick"):
        quick((1,), (), [], [], True)


def _record(released: list[tuple[int, int]]) -> Any:
    return lambda handle, nbytes: released.append((handle, nbytes))


@pytest.mark.parametrize(
    ("sizes", "strides", "dtype"),
    [
        ((16, 16), (16, 1), torch.float32),
        ((4, 4), (1, 4), torch.float32),  # column-major
        ((2, 3, 4, 5), (60, 1, 15, 3), torch.float16),  # channels-last
        ((0, 7), (7, 1), torch.int64),
        ((), (), torch.bool),
        ((8,), (2,), torch.complex64),
    ],
)
def test_native_new_tensor_makes_what_the_python_path_makes(
    device: None, sizes: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Layout (sizes, strides, offset, contiguity in each memory format), dtype, device,
    dispatch keys, the storage's fake address and bytes; freed once, by the same release,
    when the last view dies."""
    native = _guard.native_new_tensor()
    released: list[tuple[int, int]] = []
    made = []
    for way in (native, None):
        _tensors.use_native(way)
        try:
            t = _tensors.new_tensor(41, 4096, sizes, strides, dtype, 0, _record(released))
        finally:
            _tensors.use_native(native)
        made.append(
            (
                tuple(t.shape),
                t.stride(),
                t.storage_offset(),
                t.dtype,
                str(t.device),
                str(torch._C._dispatch_keys(t)),
                t.is_contiguous(),
                t.is_contiguous(memory_format=torch.channels_last) if t.dim() == 4 else None,
                t.untyped_storage().data_ptr(),
                t.untyped_storage().nbytes(),
                t.requires_grad,
            )
        )
        view = t.view(-1)[1:] if t.dim() and t.is_contiguous() else t
        del t
        gc.collect()
        assert not released, "freed while a view lives"
        del view
        gc.collect()
        assert released == [(41, 4096)], released
        released.clear()
    assert made[0] == made[1]
    assert made[0][8] == 41 << _tensors.SHIFT


def test_native_new_tensor_refuses_a_tensor_beyond_its_storage(device: None) -> None:
    native = _guard.native_new_tensor()
    with pytest.raises(RuntimeError, match="beyond its storage"):
        native(41 << 32, 1024, (16, 17), (17, 1), torch.float32, 0)
    with pytest.raises(RuntimeError, match="sizes"):
        native(41 << 32, 1024, (2,), (1, 1), torch.float32, 0)
    with pytest.raises(RuntimeError, match="no such storage"):
        native(41 << 32, 1024, (2,), (1,), torch.float32, 99)
    with pytest.raises(TypeError, match="new_tensor"):
        native(41 << 32, 1024, (2,), (1,), "float32", 0)


def _program() -> list[torch.Tensor]:
    """Eager ops of every kind of return the native call makes (one new tensor, an operand
    written in place, nothing, several tensors), with floats, keywords and tensor lists;
    each signature three times (its template is kept at its second call)."""
    x = torch.arange(24.0, device="gpuremote").view(4, 6)
    w = torch.ones(6, 3, device="gpuremote")
    out: list[torch.Tensor] = []
    for k in range(3):
        y = x + x
        y.add_(1.0 + k)
        y.mul_(0.5)
        z = (y @ w).relu()
        values, indices = z.max(dim=0)
        normed = torch.nn.functional.layer_norm(z, (3,))
        soft = torch.softmax(z, dim=1)
        fused = y.addcmul(y, y, value=0.25)
        pair = [y.clone(), z.clone()]
        torch._foreach_add_(pair, 1.0)
        torch._foreach_mul_(pair, 2.0)
        out += [y, z, values, indices, normed, soft, fused, *pair]
    return [t.cpu() for t in out]


def _run(native: bool) -> tuple[list[torch.Tensor], list[Any], int, int]:
    """``_program`` on a session of its own with the native call on or off: its results,
    what its session was handed to send (handles numbered in order of first sight), the
    calls the native call made, and the bytes its tensors held at the end."""
    from gpuremote.torch._backend import dispatcher

    conn = gt.connect_local("numpy")
    saved = dispatcher.native
    made = [0]
    if native:
        assert saved is not None
        call, ctx, missed = saved

        def counted(*args: Any) -> Any:
            result = call(*args)
            made[0] += result is not missed
            return result

        dispatcher.native = (counted, ctx, missed)
    else:
        dispatcher.native = None
    d = dispatcher.driver(0)
    posted: list[Any] = []
    numbers: dict[int, int] = {}
    submit = d.session.submit

    def recording_submit(
        spec: Any, stream: int, args: list[Any], buffer: Any = None, **options: Any
    ) -> None:
        if spec.name == "aten_call":
            template, places, handles, floats = args
            posted.append(
                (
                    spec.name,
                    template,
                    [
                        numbers.setdefault(p, len(numbers)) if i % 2 == 0 else p
                        for i, p in enumerate(places)
                    ],
                    [numbers.setdefault(h, len(numbers)) for h in handles],
                    list(floats),
                )
            )
        else:
            posted.append((spec.name,))
        submit(spec, stream, args, buffer, **options)

    d.session.submit = recording_submit  # type: ignore[method-assign]
    d.native_calls = None
    try:
        results = _program()
        gc.collect()
        held = _tensors.memory_stats(0).allocated
        return results, posted, made[0], held
    finally:
        dispatcher.native = saved
        conn.close()


def test_native_call_makes_what_the_python_path_makes(device: None) -> None:
    """An eager op's call by template in C (``Dispatcher.use_native``) posts the same calls
    as ``_by_template``, in the same order, and returns the same results; the program's
    tensors hold the same bytes after."""
    from gpuremote.torch._backend import dispatcher

    if dispatcher.native is None:
        pytest.skip("the guard library's call is not in use")
    got, posted, made, held = _run(native=True)
    want, posted_py, made_py, held_py = _run(native=False)
    assert made > 20 and made_py == 0
    assert posted == posted_py
    assert held == held_py
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def test_native_call_misses_what_it_does_not_make(device: None) -> None:
    """Where the Python path would not go by template, neither does the native call: an op
    it keeps no template for, a CPU or lazily conjugated operand, a closed session, a
    recording, more than one device; and it refuses a malformed context."""
    from gpuremote.torch._backend import dispatcher

    if dispatcher.native is None:
        pytest.skip("the guard library's call is not in use")
    call, ctx, missed = dispatcher.native
    conn = gt.connect_local("numpy")
    try:
        add = torch.ops.aten.add.Tensor
        x = torch.ones(3, device="gpuremote")
        for _ in range(3):
            x + x  # (its template kept)
        assert call(ctx, add, (x, x), {}) is not missed
        assert call(ctx, torch.ops.aten.sub.Tensor, (x, x), {}) is missed  # no template yet
        assert call(ctx, add, (x, torch.ones(3)), {}) is missed  # a CPU operand
        z = torch.ones(3, dtype=torch.complex64, device="gpuremote")
        for _ in range(3):
            z + z
        assert call(ctx, add, (z, z), {}) is not missed
        assert call(ctx, add, (z.conj(), z), {}) is missed  # a lazy bit
        d = dispatcher.driver(0)
        d.recording, before = object(), d.recording
        try:
            assert call(ctx, add, (x, x), {}) is missed
        finally:
            d.recording = before
        dispatcher.drivers[1] = d
        try:
            assert call(ctx, add, (x, x), {}) is missed
        finally:
            del dispatcher.drivers[1]
        with pytest.raises(TypeError):
            call(ctx[:-1], add, (x, x), {})
        with pytest.raises(TypeError):
            call(ctx, add, [x, x], {})
    finally:
        conn.close()
    assert call(ctx, torch.ops.aten.add.Tensor, (x, x), {}) is missed  # closed
