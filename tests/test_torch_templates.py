"""Eager ATen ops by template (``aten_template`` / ``aten_call``): the first call of an op
signature keeps it on the proxy, later calls send places and floats only. The results equal
the whole ``aten`` call's; a hostile template or call gets a clear error and its session
and the others go on; a failover keeps the templates; the session's limit holds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the proxy runs ATen ops with the [torch] extra")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import gpuremote.torch as gt  # noqa: E402
from gpuremote.core.driver import SyncDriver  # noqa: E402
from gpuremote.errors import RemoteCallError  # noqa: E402
from gpuremote.tools.proxyprocess import LocalProxy  # noqa: E402
from gpuremote.wire.calls import BUFFER, CALLS_BY_NAME  # noqa: E402

C = CALLS_BY_NAME
ADD = [[{"t": 0}, {"t": 1}], {}]  # add.Tensor(t0, t1)


@pytest.fixture(scope="module")
def proxy_url() -> Iterator[str]:
    with LocalProxy("tcp", "numpy") as p:
        yield p.url


@pytest.fixture
def sessions(proxy_url: str) -> Iterator[tuple[SyncDriver, SyncDriver]]:
    a, b = SyncDriver(proxy_url), SyncDriver(proxy_url)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _upload(d: SyncDriver, values: list[float]) -> int:
    data = np.asarray(values, dtype=np.float32)
    h = d.session.new_handle()
    d.post(C["alloc"], 0, [h, data.nbytes])
    d.post(
        C["copy_h2d"], 0, [[h, 0, [data.nbytes], "uint8"], BUFFER], memoryview(data.view(np.uint8))
    )
    return h


def _read(d: SyncDriver, h: int, n: int) -> list[float]:
    _, bufs = d.call(C["copy_d2h"], [[h, 0, [4 * n], "uint8"]])
    return np.frombuffer(bufs[0], dtype=np.float32).tolist()


def _layout(n: int) -> list[Any]:
    return [0, 0, [n], [1], "float32"]


def _template(d: SyncDriver, op: str = "add.Tensor", args: Any = ADD, n: int = 4) -> int:
    t = d.session.new_handle()
    d.post(C["aten_template"], 0, [t, op, [_layout(n), _layout(n)], args, [_layout(n)]])
    return t


def _error(d: SyncDriver) -> RemoteCallError:
    with pytest.raises(RemoteCallError) as info:
        d.call(C["device_synchronize"], [])
    return info.value


# -- the front end ----------------------------------------------------------------------------
def test_eager_ops_after_the_first_go_by_template_and_equal_the_whole_calls() -> None:
    """A step of eager ops (a float argument that changes per call among them) run twice:
    once with templates, once with every call whole (``aten``); the same bits."""
    import gpuremote.torch._templates as templates

    def program() -> list[Any]:
        torch.manual_seed(0)
        x = torch.randn(8, 5, device="gpuremote")
        w = torch.randn(5, 3, device="gpuremote", requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        for step in range(4):
            for g in opt.param_groups:
                g["lr"] = 0.1 / (step + 1)  # a float that changes at each call
            loss = torch.nn.functional.dropout(x @ w, 0.25).relu().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [w.detach().cpu(), loss.detach().cpu()]

    with gt.connect_local("numpy") as conn:
        templated = program()
        d = conn.drivers[0]
        assert d.templates  # the signatures kept on the proxy
    most = templates._MOST_TEMPLATES
    templates._MOST_TEMPLATES = 0  # every call whole
    try:
        with gt.connect_local("numpy") as conn:
            whole = program()
            assert not conn.drivers[0].templates
    finally:
        templates._MOST_TEMPLATES = most
    for a, b in zip(templated, whole, strict=True):
        assert torch.equal(a, b)


def test_sessions_of_one_program_share_their_templates_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A template's function is compiled once for every session of the proxy that makes the
    same one (the same program in a new session compiles nothing), each session's results
    its own; the code kept is bounded."""
    from gpuremote.proxy import templates

    def program() -> torch.Tensor:
        torch.manual_seed(0)
        x = torch.randn(8, 5, device="gpuremote")
        w = torch.randn(5, 3, device="gpuremote", requires_grad=True)
        for _ in range(3):
            loss = (x @ w).relu().sum()
            loss.backward()
            with torch.no_grad():
                w -= 0.1 * w.grad
                w.grad = None
        return w.detach().cpu()

    monkeypatch.setattr(templates, "_CODE", {})
    with gt.connect_local("numpy"):
        first = program()
    compiled = dict(templates._CODE)
    assert compiled, "no template's function was made"
    with gt.connect_local("numpy") as conn:
        again = program()
        assert conn.drivers[0].templates
    assert compiled == templates._CODE  # (the same code objects: nothing compiled again)
    assert torch.equal(first, again)
    monkeypatch.setattr(templates, "_CODE", {})
    monkeypatch.setattr(templates, "_MOST_CODE", 2)
    with gt.connect_local("numpy"):
        assert torch.equal(program(), first)
    assert 0 < len(templates._CODE) <= 2


@pytest.mark.parametrize("way", ["native", "python"])
def test_a_kept_calls_signature_is_the_encoders(way: str) -> None:
    """A kept template's call is made from ``quick_signature`` (no wire form): it gives the
    signature, places and floats ``Encoder`` gives the same arguments (keywords too),
    floats' values in the signature or not; None where the encoder must run (a CPU scalar
    it uploads, a lazy bit it resolves, a value of another kind). Both ways: the guard
    library's C ``quick`` and Python's ``_quick``."""
    from gpuremote.torch import _encoding, _guard
    from gpuremote.torch._encoding import Encoder, quick_signature

    conn = gt.connect_local("numpy")
    if way == "native" and _guard.native_quick() is None:
        conn.close()
        pytest.skip(f"the guard library is not loaded: {_guard.why_not()}")
    _encoding.use_native(_guard.native_quick() if way == "native" else None)
    try:
        x = torch.arange(12.0, device="gpuremote").view(3, 4)
        for args in [
            (x, x),
            (x.t(), 2, None, True, False, "mean"),
            (x[1:], 2.5, float("nan"), -0.0, 1),
            ([x, x[0]], [1, 2], (3, [4.5, x]), torch.float16),
            (x.to(torch.int64), []),
        ]:
            for floats_matter in (True, False):
                encode = Encoder([], lambda t: t, floats_matter)
                for a in args:
                    encode(a)
                quick = quick_signature(args, {}, floats_matter)
                assert quick is not None, args
                sig, places, floats = quick
                assert tuple(sig) == encode.signature(), args
                assert hash(tuple(sig)) == hash(encode.signature())
                assert (places, floats) == (encode.places, encode.floats)
        for args, kwargs in [((x, x), {"alpha": 0.5}), ((x, x[0], x[1]), {"value": -2})]:
            for floats_matter in (True, False):
                encode = Encoder([], lambda t: t, floats_matter)
                for a in args:
                    encode(a)
                encode.keywords(kwargs)
                quick = quick_signature(args, kwargs, floats_matter)
                assert quick is not None and tuple(quick[0]) == encode.signature()
                assert (quick[1], quick[2]) == (encode.places, encode.floats)
        z = torch.ones(2, dtype=torch.complex64, device="gpuremote")
        for args in [(x, torch.tensor(2.0)), (z.conj(),), (x, torch.device("cpu"))]:
            assert quick_signature(args, {}, True) is None
        assert quick_signature((x,), {"out": torch.ones(1)}, True) is None
    finally:
        _encoding.use_native(_guard.native_quick())
        conn.close()


def test_calls_with_numbers_or_keywords_go_by_template_from_their_second_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call passing a Python number for a tensor (``x * 0.5``: PyTorch hands the kernel
    ``mul.Tensor`` with a number, run as ``mul.Scalar``) or keyword arguments (``alpha=``,
    ``value=``) is found by its quick signature from its second call on: no ``Encoder``,
    no turn through the scalar overload (counted together); one template each (the number's call
    is the scalar overload's template); the results as on the CPU, the floats each call's."""
    from gpuremote.torch import _dispatch

    encoded: list[int] = []

    class CountingEncoder(_dispatch.Encoder):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            encoded.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_dispatch, "Encoder", CountingEncoder)
    as_scalars = _dispatch.Dispatcher._numbers_as_scalars

    def counting(*args: Any) -> Any:
        encoded.append(1)
        return as_scalars(*args)

    monkeypatch.setattr(_dispatch.Dispatcher, "_numbers_as_scalars", counting)
    programs = {
        "x * s": lambda x, y, s: x * s,
        "x + 1": lambda x, y, s: x + 1,
        "x.add_(s)": lambda x, y, s: x.add_(s),
        "x.add_(y, alpha=s)": lambda x, y, s: x.add_(y, alpha=s),
        "x.addcdiv_(y, y + 1, value=s)": lambda x, y, s: x.addcdiv_(y, y + 1, value=s),
        "torch.add(x, y, alpha=2)": lambda x, y, s: torch.add(x, y, alpha=2),
    }
    with gt.connect_local("numpy") as conn:
        for code, program in programs.items():
            cpu = (torch.arange(4.0), torch.full((4,), 2.0))
            remote = tuple(t.to("gpuremote") for t in cpu)
            for s in (0.25, -1.5):  # (the first calls keep the signatures: a functional
                program(*remote, s)  # op's floats are in its signature, an in-place op's not)
            cpu[0].copy_(remote[0].cpu())
            before, templates = len(encoded), conn.stats()["templates"]
            for s in (0.25, -1.5, 0.25):
                mine, theirs = program(*remote, s), program(*cpu, s)
                assert torch.equal(mine.cpu(), theirs), code
                assert torch.equal(remote[0].cpu(), cpu[0]), code
            # (``y + 1`` is a call with a number too: it goes by template as well)
            assert len(encoded) == before, code
            assert conn.stats()["templates"] == templates, code


def test_numbers_of_other_types_are_other_signatures() -> None:
    """``2 == 2.0 == True`` in Python, not to an op: ``x * 2`` after ``x * 2.0`` on integers
    is an integer product (before, the second reused the first's signature and its
    result's dtype, and the proxy refused the call); a NaN is one signature, not one a
    call."""
    with gt.connect_local("numpy") as conn:
        x = torch.arange(4, device="gpuremote")
        ints, floats, bools = x * 2, x * 2.0, x.mul(True)
        assert (ints.dtype, floats.dtype, bools.dtype) == (torch.int64, torch.float32, torch.int64)
        assert floats.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]
        assert ints.cpu().tolist() == [0, 2, 4, 6] and bools.cpu().tolist() == [0, 1, 2, 3]
        y = torch.ones(3, device="gpuremote")
        before = conn.stats()["templates"]
        for _ in range(5):
            z = torch.add(y, y, alpha=float("nan"))
        assert conn.stats()["templates"] == before + 1
        assert z.cpu().isnan().all()


def test_a_timing_device_takes_the_same_time_by_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """On ``sim:a100,compute=0`` (ops timed on their shapes) a template's first call runs
    as the ``aten`` call it stands for, and its later calls take the work it found: the
    device's time for a step is the same as with every call whole."""
    import gpuremote.torch._templates as templates
    from gpuremote.proxy.templates import AtenTemplate

    timed: list[str] = []
    run_timed = AtenTemplate.run_timed

    def counted(self: AtenTemplate, *args: Any) -> None:
        timed.append(self.name)
        run_timed(self, *args)

    monkeypatch.setattr(AtenTemplate, "run_timed", counted)

    def device_time() -> float:
        with gt.connect_local("sim:a100,compute=0") as conn:
            a = torch.ones(512, 512, device="gpuremote")
            w = torch.ones(512, 512, device="gpuremote", requires_grad=True)
            for _ in range(3):
                ((a @ w).relu() * 0.5).sum().backward()
            conn.synchronize()
            assert (len(conn.drivers[0].templates) > 3) == (templates._MOST_TEMPLATES > 0)
            queued, _ = conn.drivers[0]._proxy.backend.timing()
            return float(queued)

    templated = device_time()
    assert "mm.default" in timed and "relu.default" in timed  # (later calls, by their work)
    most = templates._MOST_TEMPLATES
    templates._MOST_TEMPLATES = 0  # every call whole
    try:
        whole = device_time()
    finally:
        templates._MOST_TEMPLATES = most
    assert templated > 0 and templated == pytest.approx(whole, rel=1e-9)


def test_what_a_proxy_answered_is_its_sessions_alone() -> None:
    """What a proxy's kernel answers about a signature (the layouts its meta kernel does not
    know: eval-mode batch norm's saved statistics, empty on the CPU) holds for its session
    only: a timing-only device's answer (the meta kernel's) is not a CPU proxy's session's.
    (Before, the second session's op was refused: "the client expected float32 [3]".)"""
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    mean, var = torch.zeros(3), torch.ones(3)
    expected = torch.nn.functional.batch_norm(x, mean, var, training=False)
    saved = []
    for backend in ("sim:a100,compute=0", "numpy"):
        with gt.connect_local(backend) as conn:
            got = torch.nn.functional.batch_norm(
                x.to("gpuremote"), mean.to("gpuremote"), var.to("gpuremote"), training=False
            ).cpu()
            metas = conn.drivers[0].metas
            saved += [v[0][1][0] for k, v in metas.items() if k[0].name.startswith("native_b")]
    assert saved == [[3], [0]]  # (the meta kernel's statistics; the CPU's: none)
    assert torch.equal(got, expected)


def test_a_timing_device_runs_attention_as_the_cpus_kernels_choose() -> None:
    """``sim:a100,compute=0`` answers ``_fused_sdp_choice`` as the CPU's kernels would for
    operands of those layouts (one fused attention op, as a GPU runs it), not as meta
    tensors do (the math decomposition, a dozen ops); the fused op's FLOPs are counted."""
    q = torch.randn(2, 4, 16, 8)
    with gt.connect_local("sim:a100,compute=0") as conn:
        x = q.to("gpuremote")
        torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).cpu()
        names = {k[0].name for k in conn.drivers[0].metas}
    assert "_scaled_dot_product_flash_attention_for_cpu.default" in names
    assert not {"bmm.default", "_softmax.default"} & names
    from gpuremote.proxy.aten import op_work

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    m = q.to("meta")
    made = list(op(m, m, m, 0.0, True))
    flops, _, _ = op_work(op, [m, m, m, 0.0, True], {}, tuple(made), [m, m, m], made)
    assert flops == 4 * 2 * 4 * 16 * 16 * 8  # (QK^T and PV: 2 FLOPs a multiply-add each)


# -- hostile templates and calls --------------------------------------------------------------
def test_a_template_of_an_op_off_the_allow_list_is_refused_and_each_call_says_so(
    sessions: tuple[SyncDriver, SyncDriver],
) -> None:
    d, other = sessions
    x = _upload(d, [1, 2, 3, 4])
    t = _template(d, "set_.source_Storage")
    err = _error(d)
    assert err.call == "aten_template" and "allow-list" in err.message
    out = d.session.new_handle()
    d.post(C["aten_call"], 0, [t, [x, 0, x, 0], [out], []])
    err = _error(d)
    assert err.call == "aten_call" and "allow-list" in err.message
    # the session goes on, its output handle made: it may be freed
    d.post(C["free"], 0, [out])
    y = _upload(other, [5, 6, 7, 8])
    _ok(other, y)


def _ok(d: SyncDriver, h: int) -> int:
    """A good template and call run in ``d``'s session; the template's handle."""
    t = _template(d)
    out = d.session.new_handle()
    d.post(C["aten_call"], 0, [t, [h, 0, h, 0], [out], []])
    before = _read(d, h, 4)
    assert _read(d, out, 4) == [2 * v for v in before]
    return t


@pytest.mark.parametrize(
    ("places", "outputs", "floats", "says"),
    [
        ([1, 0], [9], [], "takes 2 operands"),  # one operand short
        ([1, 0, 1, 0], [], [], "takes 2 operands, 1 outputs"),  # no output
        ([1, 0, 1, 0], [9], [0.5], "0 floats"),  # a float it does not take
        ([1, 0, 1, 4], [9], [], "reaches byte 20"),  # past the buffer
        ([1, 0, 1, 2], [9], [], "not a multiple of 4"),  # between elements
        ([1, 0, 77, 0], [9], [], "unknown buffer handle 77"),  # not the session's
        ([1, 0, 1, 0], [1], [], "already in use"),  # an output over an operand
    ],
)
def test_a_bad_call_of_a_template_is_refused_and_the_session_goes_on(
    sessions: tuple[SyncDriver, SyncDriver],
    places: list[int],
    outputs: list[int],
    floats: list[float],
    says: str,
) -> None:
    d, other = sessions
    x = _upload(d, [1, 2, 3, 4])
    assert x == 1
    theirs = _upload(other, [9, 9, 9, 9])
    t = _template(d)
    d.post(C["aten_call"], 0, [t, places, [x + 100 if o == 9 else o for o in outputs], floats])
    err = _error(d)
    assert err.call == "aten_call" and err.op == "add.Tensor", err
    assert says in err.message, err.message
    assert _read(d, x, 4) == [1, 2, 3, 4]  # nothing of it written
    _ok(d, x)
    assert _read(other, theirs, 4) == [9, 9, 9, 9]
    _ok(other, theirs)


def test_an_unknown_template_is_an_unknown_handle(sessions: tuple[SyncDriver, SyncDriver]) -> None:
    d, _ = sessions
    x = _upload(d, [1, 2, 3, 4])
    d.post(C["aten_call"], 0, [12345, [x, 0, x, 0], [x + 1], []])
    err = _error(d)
    assert err.kind == "UnknownHandle" and "template" in err.message
    d.post(C["free"], 0, [x + 1])  # (not made: the template's outputs are unknown)
    with pytest.raises(RemoteCallError):
        d.call(C["device_synchronize"], [])
    _ok(d, x)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([[{"t": 0}, {"t": 2}], {}], "tensor 2 of 2"),  # an operand it has not
        ([[{"t": 0}, {"t": 1}], {"alpha": {"dtype": "nope"}}], "unsupported dtype"),
    ],
)
def test_a_malformed_template_is_refused(
    sessions: tuple[SyncDriver, SyncDriver], args: Any, says: str
) -> None:
    d, _ = sessions
    x = _upload(d, [1, 2, 3, 4])
    _template(d, args=args)
    err = _error(d)
    assert err.call == "aten_template" and says in err.message, err.message
    _ok(d, x)


def test_the_tensors_the_templates_hold_are_limited() -> None:
    """A session's templates hold at most ``max_template_tensors`` layouts together; the
    client keeps below half of what its proxy announces."""
    from gpuremote.proxy.state import SessionLimits

    limits = SessionLimits(max_template_tensors=10)
    with gt.connect_local("numpy", session_limits=limits) as conn:
        d = conn.drivers[0]
        assert d.info["max_template_tensors"] == 10
        a = torch.ones(4, device="gpuremote")  # fill_: 1 layout, kept
        b = a + a  # 3 more: 4, kept
        c = a * a  # 7: past half of 10, sent whole
        e = a - a  # (and so on)
        assert conn.stats()["templates"] == 2 and conn.stats()["template_tensors"] == 4
        assert (b + c + e).cpu().tolist() == [3.0] * 4
        t = d.session.new_handle()  # past the limit itself: refused, the session goes on
        layouts = [[0, 0, [4], [1], "float32"]] * 7
        d.post(C["aten_template"], 0, [t, "add.Tensor", layouts, ADD, layouts[:1]])
        assert "would hold 12 tensors; the limit is 10" in _error(d).message
        assert (a + a).cpu().tolist() == [2.0] * 4


def test_the_sessions_templates_are_limited() -> None:
    """Past ``serve --max-templates`` a template is refused with the limit named; the
    session and the templates it keeps go on."""
    with LocalProxy("tcp", "numpy", extra_args=("--max-templates", "2")) as p:
        d = SyncDriver(p.url)
        try:
            x = _upload(d, [1, 2, 3, 4])
            kept = _ok(d, x)
            _ok(d, x)
            _template(d)
            err = _error(d)
            assert err.call == "aten_template", err
            assert "keeps 2 ATen templates; the limit is 2" in err.message
            out = d.session.new_handle()
            d.post(C["aten_call"], 0, [kept, [x, 0, x, 0], [out], []])
            assert _read(d, out, 4) == [2, 4, 6, 8]
        finally:
            d.close()


def test_outputs_naming_one_handle_twice_are_refused(
    sessions: tuple[SyncDriver, SyncDriver],
) -> None:
    """An op's two new tensors under one handle: refused (whole or by template), nothing
    kept twice; the session goes on."""
    d, _ = sessions
    x = _upload(d, [1, 2, 3, 4])
    out = d.session.new_handle()
    made = [out, 0, [4], [1], "float32"]
    d.post(
        C["aten"],
        0,
        [
            "sort.default",
            [[x, 0, [4], [1], "float32"]],
            [[{"t": 0}], {}],
            [
                made,
                [out, 0, [4], [1], "int64"],
            ],
        ],
    )
    assert "a handle of their own" in _error(d).message
    t = d.session.new_handle()
    d.post(
        C["aten_template"],
        0,
        [
            t,
            "sort.default",
            [_layout(4)],
            [[{"t": 0}], {}],
            [
                _layout(4),
                [0, 0, [4], [1], "int64"],
            ],
        ],
    )
    other = d.session.new_handle()
    d.post(C["aten_call"], 0, [t, [x, 0], [other, other], []])
    assert "a handle of their own" in _error(d).message
    _ok(d, x)


def test_an_out_op_cannot_grow_the_memory_under_a_kept_buffer(
    sessions: tuple[SyncDriver, SyncDriver],
) -> None:
    """A buffer an op made is the tensor it made (no copy), and the views an op only reads
    are taken of that tensor; an ``out=`` op whose ``out`` is a view of such a buffer too
    small for the result is refused (the buffer's memory cannot grow), not run on memory
    moved from under the buffer, and the buffer and the session go on."""
    d, other = sessions
    x = _upload(d, [1, 2, 3, 4])
    kept = d.session.new_handle()
    d.post(C["aten_call"], 0, [_template(d), [x, 0, x, 0], [kept], []])
    assert _read(d, kept, 4) == [2, 4, 6, 8]
    grow = d.session.new_handle()  # add.out(x, x, out=<2 floats of kept, from byte 8>)
    out_args = [[{"t": 0}, {"t": 1}], {"out": {"t": 2}}]
    layouts = [_layout(4), _layout(4), _layout(2)]
    d.post(C["aten_template"], 0, [grow, "add.out", layouts, out_args, []])
    for _ in range(2):
        d.post(C["aten_call"], 0, [grow, [x, 0, x, 0, kept, 8], [], []])
        err = _error(d)
        assert err.call == "aten_call" and "resiz" in err.message, err.message
        assert _read(d, kept, 4) == [2, 4, 6, 8]
    again = d.session.new_handle()
    d.post(C["aten_call"], 0, [_template(d), [kept, 0, kept, 0], [again], []])
    assert _read(d, again, 4) == [4, 8, 12, 16]
    _ok(other, _upload(other, [1, 1, 1, 1]))


def test_an_op_that_writes_a_kept_buffers_elements_shares_its_views_one_that_lays_out_does_not(
    sessions: tuple[SyncDriver, SyncDriver],
) -> None:
    """An in-place op that writes elements only (``mul_``) may take its operand's view of
    the tensor kept as a buffer, and keep it for its next call; an op that lays its operand
    out again in place (``squeeze_``) takes a view of its own, so that a view kept for a
    reading op keeps the client's layout."""
    d, other = sessions
    x = _upload(d, [1, 2, 3, 4])
    kept = d.session.new_handle()
    d.post(C["aten_call"], 0, [_template(d), [x, 0, x, 0], [kept], []])  # kept as made
    scale = d.session.new_handle()
    d.post(
        C["aten_template"], 0, [scale, "mul_.Scalar", [_layout(4)], [[{"t": 0}, {"f": 0}], {}], []]
    )
    for _ in range(2):
        d.post(C["aten_call"], 0, [scale, [kept, 0], [], [3.0]])
    assert _read(d, kept, 4) == [18, 36, 54, 72]
    row = [0, 0, [1, 4], [4, 1], "float32"]
    total = d.session.new_handle()
    d.post(
        C["aten_template"],
        0,
        [total, "sum.dim_IntList", [row], [[{"t": 0}, [1]], {}], [[0, 0, [1], [1], "float32"]]],
    )
    squeeze = d.session.new_handle()
    d.post(C["aten_template"], 0, [squeeze, "squeeze_.dim", [row], [[{"t": 0}, 0], {}], []])
    sums = []
    for _ in range(2):  # a sum over the row's dim 1, a squeeze_ of the same view, a sum again
        s1, s2 = d.session.new_handle(), d.session.new_handle()
        d.post(C["aten_call"], 0, [total, [kept, 0], [s1], []])
        d.post(C["aten_call"], 0, [squeeze, [kept, 0], [], []])
        d.post(C["aten_call"], 0, [total, [kept, 0], [s2], []])
        sums += [_read(d, s1, 1), _read(d, s2, 1)]
    assert sums == [[180.0]] * 4
    _ok(other, _upload(other, [1, 1, 1, 1]))


# -- the proxy's function made per template -----------------------------------------------
def _kept_templates(program: Any) -> tuple[list[tuple[Any, ...]], Any]:
    """Each template call ``program`` makes on an in-process proxy, as the proxy got it
    (template, AtenSession, SessionState, BatchContext, places, outputs, floats), and what
    ``program`` returned."""
    from gpuremote.proxy import templates

    calls: list[tuple[Any, ...]] = []
    run = templates.AtenTemplate.run

    def spy(self: Any, *call: Any) -> None:
        calls.append((self, *call))
        run(self, *call)

    templates.AtenTemplate.run = spy  # type: ignore[method-assign]
    try:
        returned = program()
    finally:
        templates.AtenTemplate.run = run  # type: ignore[method-assign]
    return calls, returned


class _Seen(TorchDispatchMode):
    """A dispatch mode that notes the ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _outcome(way: Any, a: Any, s: Any, ctx: Any, places: Any, outputs: Any, floats: Any) -> Any:
    """What one way of running a template's call did: its error, or its outputs' bytes and
    its operands' (after it), and the buffers its job read and wrote in stream order; then
    its outputs are freed and its operands' bytes put back."""

    def whole(h: int) -> Any:
        return a.strided(h, 0, (s.nbytes[h],), (1,), "uint8", s.nbytes[h])

    held = set(s.buffers)
    operands = [h for h in places[::2] if h in held]
    before = [whole(h).clone() for h in operands]
    ordered: list[Any] = []  # the buffers the stream orders the op's job after, by handle
    run = a.runtime.run

    def spy(job: Any, reads: Any, writes: Any, stream: Any) -> Any:
        handle = {id(b): h for h, b in s.buffers.items()}
        ordered.append(([handle[id(b)] for b in reads], [handle[id(b)] for b in writes]))
        return run(job, reads, writes, stream)

    a.runtime.run = spy
    try:
        way(a, s, ctx, places, outputs, floats)
    except Exception as exc:
        result: Any = (type(exc).__name__, str(exc), ordered)
    else:
        result = [bytes(whole(h).numpy()) for h in (*outputs, *operands)], ordered
    finally:
        del a.runtime.run
    s.free([h for h in outputs if h not in held])
    for h, b in zip(operands, before, strict=True):
        whole(h).copy_(b)
    return result


@pytest.mark.parametrize("backend", ["numpy", "sim:check"])
def test_a_templates_own_function_does_what_the_general_way_does(backend: str) -> None:
    """Each template of common ops gets a function of its own (``AtenTemplate.fast``); on
    each call, good or bad (another operand, a place off its buffer, a handle unknown or in
    use, the wrong counts), it does what ``_run`` does: the same bytes, the same error. On
    NumPy the ops' results are kept as buffers; on ``sim:check`` (as on a GPU) each output
    is a buffer of the device's, filled."""

    def program() -> list[Any]:
        a = torch.arange(16.0, device="gpuremote")
        b = torch.full((16,), 0.5, device="gpuremote")
        w = torch.arange(16.0, device="gpuremote").reshape(4, 4)
        c = torch.empty(16, device="gpuremote")
        for _ in range(3):  # (the later calls go by template)
            a + b
            a.add_(1.0)
            torch.relu(a - 8)
            w @ w.t()
            a.addcmul_(a, b, value=0.5)
            torch.add(a, b, alpha=2)
            torch.max(w, dim=0)
            a[2:10] * b[:8]
            torch.add(a, b, out=c)
            torch._foreach_mul_([a, c], 0.5)  # (lists of operands)
            torch._foreach_add([a, b], [b, c], alpha=0.25)
            torch.cat([a, b, c[:4]])
        float(a.sum())
        # a template whose output the client lays out by columns: the op's (by rows) is
        # copied into that layout, not kept as it is
        d = conn.drivers[0]
        t = d.session.new_handle()
        square = [0, 0, [4, 4], [4, 1], "float32"]
        by_columns = [0, 0, [4, 4], [1, 4], "float32"]
        d.post(C["aten_template"], 0, [t, "add.Tensor", [square, square], ADD, [by_columns]])
        from gpuremote.torch._tensors import handle_of

        h = handle_of(w)
        for _ in range(2):
            d.post(C["aten_call"], 0, [t, [h, 0, h, 0], [d.session.new_handle()], []])
        conn.synchronize()
        return [a, b, w, c]

    with gt.connect_local(backend) as conn:
        calls, _alive = _kept_templates(program)
        conn.synchronize()
        assert calls
        names = {c[0].name for c in calls}
        assert {
            "add.Tensor",
            "add_.Scalar",
            "mm.default",
            "addcmul_.default",
            "max.dim",
            "_foreach_mul_.Scalar",
            "_foreach_add.List",
            "cat.default",
        } <= names
        assert any(o[1] == (1, 4) for c in calls for o in c[0].outputs)  # (by columns)
        assert all(c[0].fast is not None for c in calls)
        seen = set()
        for template, a, s, ctx, places, outputs, floats in calls:
            if (template.name, template.outputs) in seen:
                continue
            seen.add((template.name, template.outputs))
            new = tuple(range(1 << 40, (1 << 40) + len(outputs)))
            held = next(iter(s.buffers))
            n = len(places)
            variants = [
                (places, new),
                (places[:-2], new),  # an operand short
                (places, (*new[:-1], new[0]) if len(new) > 1 else ()),  # one handle twice
                (places, (held, *new[1:])),  # a handle in use
                ((1 << 41, *places[1:]), new),  # an unknown buffer
                ((places[0], places[1] + (1 << 20), *places[2:]), new),  # off its buffer
                ((places[0], places[1] + 1, *places[2:]), new),  # not at an element
                ((*places[: n - 2], places[0], 0), new),  # another operand, another buffer
            ]
            for p, o in variants:
                fast = _outcome(template.fast, a, s, ctx, p, o, floats)
                general = _outcome(template._run, a, s, ctx, p, o, floats)
                assert fast == general, (template.name, p, o)
            # in a thread with dispatch modes (a proxy in the client's process, tracing), the
            # op runs as plain torch, set aside from them
            with _Seen() as mode:
                fast = _outcome(template.fast, a, s, ctx, places, new, floats)
            assert fast == _outcome(template._run, a, s, ctx, places, new, floats)
            assert template.allowed.op not in mode.ops
