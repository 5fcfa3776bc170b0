"""``gpuremote:0..k-1`` in one process: one session per device, the device guard library
(``gpuremote/torch/_guard.cpp``, built with torch's cpp_extension), tensors moved proxy to
proxy. Each test runs in a fresh interpreter: the guard and PyTorch's autograd device threads
are per process (the threads are sized at the first backward pass)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

WORKER = """
import json, os, torch
from torch import nn
import gpuremote.torch as gt

urls = os.environ["TEST_URLS"]
conn = gt.connect(urls)
out = {"devices": [str(d) for d in conn.devices], "count": torch.gpuremote.device_count()}

# placement and copies between devices (proxy to proxy)
x = torch.arange(12.0).reshape(3, 4).to("gpuremote:1")
y = x.t().to("gpuremote:0")  # a strided view, moved
out["x"] = [str(x.device), x.cpu().tolist()]
out["y"] = [str(y.device), y.cpu().tolist()]
z = torch.empty(2, 3, device="gpuremote:0")
z.copy_(torch.ones(2, 3, device="gpuremote:1", dtype=torch.float64))  # converts, then moves
out["z"] = z.cpu().tolist()
torch.gpuremote.set_device(1)
out["current"] = [torch.gpuremote.current_device(), str(torch.zeros(1, device="gpuremote").device)]
torch.gpuremote.set_device(0)
with torch.gpuremote.device(1):
    out["inside"] = str(torch.ones(1, device="gpuremote").device)
with torch.device("gpuremote:1"):
    out["default_device"] = str(torch.ones(1).device)
out["after"] = str(torch.ones(1, device="gpuremote").device)
try:
    torch.ones(2, device="gpuremote:0") + torch.ones(2, device="gpuremote:1")
    out["mixed"] = "no error"
except RuntimeError as exc:
    out["mixed"] = str(exc)

# a two-stage model, pipeline style: stage 0 on gpuremote:0, stage 1 on gpuremote:1
torch.manual_seed(0)
stages = [nn.Sequential(nn.Linear(8, 2048), nn.ReLU()), nn.Sequential(nn.Linear(2048, 4))]
import copy
ref = copy.deepcopy(stages)
stage0, stage1 = stages[0].to("gpuremote:0"), stages[1].to("gpuremote:1")
params = [*stage0.parameters(), *stage1.parameters()]
opt = torch.optim.SGD(params, lr=0.1)
ref_opt = torch.optim.SGD([*ref[0].parameters(), *ref[1].parameters()], lr=0.1)
data, target = torch.randn(16, 8), torch.randn(16, 4)
transfers = gt.dispatcher.transfers
before = [gt.stats(i) for i in (0, 1)]
copies = transfers.proxy_to_proxy
losses = []
for _ in range(4):
    h = stage0(data.to("gpuremote:0"))
    pred = stage1(h.to("gpuremote:1"))
    loss = ((pred - target.to("gpuremote:1")) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ref_loss = ((ref[1](ref[0](data)) - target) ** 2).mean()
    ref_opt.zero_grad()
    ref_loss.backward()
    ref_opt.step()
    losses.append([loss.item(), ref_loss.item()])
after = [gt.stats(i) for i in (0, 1)]
out["losses"] = losses
out["weights_equal"] = all(
    torch.equal(p.cpu(), q)
    for p, q in zip(params, [*ref[0].parameters(), *ref[1].parameters()])
)
out["weights_close"] = all(
    torch.allclose(p.cpu(), q, rtol=1e-4, atol=1e-5)
    for p, q in zip(params, [*ref[0].parameters(), *ref[1].parameters()])
)
out["devices_of_params"] = sorted({str(p.device) for p in params})
out["proxy_to_proxy"] = transfers.proxy_to_proxy - copies
out["through_client"] = transfers.through_client
out["client_bytes"] = sum(
    a[k] - b[k] for a, b in zip(after, before) for k in ("bytes_sent", "bytes_received")
)
out["activation_bytes"] = 2 * 4 * 16 * 2048 * 4  # h and its gradient, 4 steps
conn.close()
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: the proxies' backend: ``GPUREMOTE_TEST_BACKENDS``' first (``scripts/gpu_check.sh``: cupy,
#: two proxies on one GPU), else numpy
BACKEND = os.environ.get("GPUREMOTE_TEST_BACKENDS", "numpy").split(",")[0]


@pytest.fixture(scope="module")
def peers() -> Iterator[list[str]]:
    """Two proxy processes, each the other's peer (so each may read from the other)."""
    urls = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    procs = []
    try:
        for me, other in ((urls[0], urls[1]), (urls[1], urls[0])):
            cmd = [sys.executable, "-m", "gpuremote", "serve", "--listen", me, "--peer", other]
            procs.append(
                subprocess.Popen(
                    [*cmd, "--backend", BACKEND, "--quiet"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for url in urls:
            _wait_listening(url)
        yield urls
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def _wait_listening(url: str, timeout: float = 30.0) -> None:
    host, port = url.removeprefix("tcp://").split(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"no proxy at {url}")


def test_two_devices_in_one_process(
    peers: list[str], python_json: Callable[..., dict[str, Any]]
) -> None:
    """``gt.connect("URL0,URL1")``: ``gpuremote:0`` and ``gpuremote:1``; tensors made on
    either (by index, by the current device, under ``torch.device``), moved between them
    proxy to proxy; an op mixing them refused as PyTorch refuses it; a two-stage model
    trained across them equal to the CPU, bitwise, with its activations never through the
    client."""
    out = python_json(WORKER, TEST_URLS=",".join(peers), OMP_NUM_THREADS="1")
    assert out["devices"] == ["gpuremote:0", "gpuremote:1"] and out["count"] == 2
    assert out["x"] == ["gpuremote:1", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]]
    assert out["y"] == ["gpuremote:0", [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]]
    assert out["z"] == [[1.0] * 3] * 2
    assert out["current"] == [1, "gpuremote:1"]
    assert out["inside"] == "gpuremote:1" and out["after"] == "gpuremote:0"
    assert out["default_device"] == "gpuremote:1"
    assert "Expected all tensors to be on the same device" in out["mixed"], out["mixed"]
    if BACKEND == "numpy":  # the CPU's kernels: bit for bit
        assert all(a == b for a, b in out["losses"]), out["losses"]
        assert out["weights_equal"]
    else:  # a GPU's
        assert out["weights_close"]
    assert out["devices_of_params"] == ["gpuremote:0", "gpuremote:1"]
    # each step: the input to 0, the activation 0 -> 1, the target to 1 are copies from the
    # host; the activation (forward) and its gradient (backward) go proxy to proxy
    assert out["proxy_to_proxy"] == 8 and out["through_client"] == 0, out
    # the client moved commands, the inputs and the losses: a tenth of the activations
    assert out["client_bytes"] < out["activation_bytes"] / 10, out


def test_without_the_guard_library_one_device_and_the_reason(
    python_json: Callable[..., dict[str, Any]],
) -> None:
    """Where the library cannot be built (here: turned off), two devices are refused with
    the reason; one device works as before."""
    out = python_json(
        """
        import json
        import gpuremote.torch as gt
        try:
            gt.connect("tcp://127.0.0.1:1,tcp://127.0.0.1:2")
            print(json.dumps({"error": ""}))
        except NotImplementedError as exc:
            print(json.dumps({"error": str(exc)}))
        """,
        GPUREMOTE_TORCH_NATIVE="0",
    )
    assert "device guard library" in out["error"] and "GPUREMOTE_TORCH_NATIVE=0" in out["error"]


def test_guard_library_builds_from_the_installed_source() -> None:
    """The C++ source ships with the package (package data) beside its loader."""
    import gpuremote.torch._guard as guard

    assert guard._SOURCE.is_file()
    assert "C10_REGISTER_GUARD_IMPL(PrivateUse1" in guard._SOURCE.read_text()
    assert os.path.basename(guard._SOURCE) == "_guard.cpp"


VIEWS = """
import json
import torch
import gpuremote.torch as gt
from gpuremote.torch import _backend, _guard

conn = gt.connect_local("numpy")
dispatcher = _backend.dispatcher
run = dispatcher.run
through_python = []

def counted(op, args, kwargs):
    through_python.append(str(op))
    return run(op, args, kwargs)

dispatcher.run = counted
VIEWS = {
    "view": lambda x: x.view(6, 4),
    "as_strided": lambda x: x.as_strided((3, 2), (5, 2), 3),
    "t": lambda x: x.t(),
    "transpose": lambda x: x.transpose(0, 1),
    "unsqueeze": lambda x: x.unsqueeze(1),
    "expand": lambda x: x[1].expand(3, 6),
    "select": lambda x: x[2],
    "slice": lambda x: x[1:3, ::2],
    "permute": lambda x: x.permute(1, 0),
    "reshape": lambda x: x.reshape(2, 12),
    "diagonal": lambda x: x.diagonal(),
    "flatten": lambda x: x.flatten(),
    "detach": lambda x: x.detach(),
    "unfold": lambda x: x.unfold(1, 2, 2),
}
base = torch.arange(24.0).reshape(4, 6)
remote = base.to("gpuremote")
layouts_equal, values_equal = [], []
for name, make in VIEWS.items():
    through_python.clear()
    v, w = make(base), make(remote)
    views_in_python = list(through_python)
    same = (w.shape, w.stride(), w.storage_offset()) == (v.shape, v.stride(), v.storage_offset())
    shared = w.untyped_storage().data_ptr() == remote.untyped_storage().data_ptr()
    layouts_equal.append([name, same and shared, len(views_in_python)])
    values_equal.append([name, torch.equal(w.cpu(), v)])
# complex numbers seen as pairs of reals, and back
cbase = torch.randn(3, 4, dtype=torch.complex64)
cremote = cbase.to("gpuremote")
through_python.clear()
pairs, back = torch.view_as_real(cremote), torch.view_as_complex(torch.view_as_real(cremote))
complex_views = [
    len(through_python),
    torch.equal(pairs.cpu(), torch.view_as_real(cbase)) and torch.equal(back.cpu(), cbase),
    pairs.stride() == torch.view_as_real(cbase).stride(),
    pairs.untyped_storage().data_ptr() == cremote.untyped_storage().data_ptr(),
]
# a write through a view reaches its base (the same storage), on both
base.t()[1:3].add_(100.0)
remote.t()[1:3].add_(100.0)
written = torch.equal(remote.cpu(), base)
# a view past its storage: the CPU's error, word for word
errors = []
for x in (base, remote):
    try:
        x.as_strided((5, 6), (6, 1), 0)
        errors.append("")
    except RuntimeError as exc:
        errors.append(str(exc))
# autograd through views
a = torch.randn(4, 6, requires_grad=True)
b = a.detach().to("gpuremote").requires_grad_()
for t in (a, b):
    (t.t()[1:4].unsqueeze(0).expand(2, 3, 4) * 2.0).sum().backward()
grads = torch.equal(b.grad.cpu(), a.grad)
print(json.dumps({
    "loaded": _guard.loaded(),
    "kernel": torch._C._dispatch_has_kernel_for_dispatch_key("aten::as_strided", "PrivateUse1"),
    "layouts": layouts_equal, "values": values_equal, "written": written,
    "errors": errors, "grads": grads, "complex": complex_views,
}))
"""


@pytest.mark.parametrize("native", ["1", "0"])
def test_views_take_the_cpus_kernels_in_cpp_else_through_python(
    python_json: Callable[..., dict[str, Any]], native: str
) -> None:
    """Views (metadata only) of a device tensor: by the guard library's C++ kernels (the
    CPU's own) where it loads, never reaching the Python fallback; by the fallback where it
    does not (``GPUREMOTE_TORCH_NATIVE=0``). Either way the CPU's layouts, values, shared
    storage (a write through a view reaches the base), errors and gradients."""
    out = python_json(VIEWS, GPUREMOTE_TORCH_NATIVE=native)
    assert out["loaded"] is (native == "1") and out["kernel"] is (native == "1"), out
    for name, same_layout, in_python in out["layouts"]:
        assert same_layout, name
        if native == "1":
            assert in_python == 0, f"{name}: {in_python} view op(s) through Python"
    if native == "0":  # (the fallback's way: every view op through Python)
        assert sum(n for _, _, n in out["layouts"]) >= len(out["layouts"]) - 1, out["layouts"]
    assert all(same for _, same in out["values"]), out["values"]
    assert out["written"] and out["grads"], out
    in_python, *complex_same = out["complex"]
    assert all(complex_same) and (in_python == 0 if native == "1" else in_python > 0), out
    assert out["errors"][0] and out["errors"][1] == out["errors"][0], out["errors"]
