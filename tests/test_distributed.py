"""torch.distributed on gpuremote devices: the ``gpuremote`` process-group backend, whose
collectives run between the proxies (``gpuremote.proxy.collectives``), under torchrun with one
proxy process per rank (NumPy backend)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpuremote.torch  # noqa: E402,F401
from gpuremote.core.driver import SyncDriver  # noqa: E402
from gpuremote.errors import RemoteCallError  # noqa: E402
from gpuremote.tools.proxyprocess import LocalProxy  # noqa: E402
from gpuremote.wire.calls import CALLS_BY_NAME  # noqa: E402

if not dist.is_available():  # pragma: no cover
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ddp.py"
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
_HOST, _JOIN, _RUN, _SYNC, _ALLOC = (
    CALLS_BY_NAME[n] for n in ("dist_host", "dist_join", "dist_run", "device_synchronize", "alloc")
)


@pytest.fixture(scope="module")
def proxies() -> Iterator[list[LocalProxy]]:
    """Two proxy processes (one per rank), one intra-op thread each (the ranks' too)."""
    started = []
    try:
        for _ in range(2):
            p = LocalProxy("tcp", "numpy", ("--quiet",))
            with _one_thread():
                p.start()
            started.append(p)
        yield started
    finally:
        for p in started:
            p.stop()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """``OMP_NUM_THREADS=1`` for the processes started inside (this one's is left as it is:
    other tests compare their proxies' results with this process's, bit for bit)."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _torchrun(proxies: list[LocalProxy], *args: str, timeout: float = 120, **env: str) -> str:
    """Run ``args`` under torchrun, 2 ranks, rank r on proxy r (or ``GPUREMOTE_URL`` of
    ``env``); returns their output."""
    environ = {
        **os.environ,
        "GPUREMOTE_URL": ",".join(p.url for p in proxies),
        "OMP_NUM_THREADS": "1",
        **env,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, *args], env=environ, capture_output=True, text=True, timeout=timeout, check=False
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and not env.get("GPUREMOTE_TEST_EXPECT_FAILURE"):
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{out[-6000:]}")
    return out


def _one_process(kind: str, steps: int, world: int = 2, batch: int = 8) -> dict[str, torch.Tensor]:
    """The example's model trained by one process on each step's global batch (the ranks'
    batches together, as DistributedSampler deals them)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from ddp import make_data, make_model
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    model, data = make_model(kind), make_data(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        idx: list[int] = []
        for r in range(world):
            idx += list(range(r, len(data), world))[step * batch : (step + 1) * batch]
        x, y = data[idx]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


def _assert_trained_alike(path: Path, expected: dict[str, torch.Tensor]) -> None:
    got = torch.load(path)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5, msg=k)


def test_ddp_fsdp2_and_every_collective_between_proxies(
    proxies: list[LocalProxy], tmp_path: Path
) -> None:
    """One torchrun, 2 ranks on 2 proxies, four process groups in turn:

    - the tutorial's DDP script (``examples/ddp.py``, an MLP) and the same under FSDP2's
      ``fully_shard`` (a 2-layer transformer): the weights after 4 steps equal one
      process's on the global batch (1e-5: the gradients are averaged in another order);
    - every collective's result (sum/avg/max/product all-reduce, broadcast, all-gather both
      ways, reduce-scatter both ways, all-to-all, reduce, CPU and strided tensors, barrier,
      a new group);
    - DDP steps: the client sends commands only (far less than the gradients) and receives
      the loss;
    - a group made, ended and made again at once, rank 0 slow to end the first: the second
      is a job of its own;
    - FSDP2 frees what it reshards: a rank's tensors hold its shards (the parameters' and
      the gradients': about one model's bytes), not whole parameters and gradients (two)."""
    log = _torchrun(
        proxies,
        str(WORKER),
        "ddp",
        "fsdp",
        "again",
        "collectives",
        "bytes",
        "memory",
        GPUREMOTE_TEST_OUT=str(tmp_path),
    )
    assert log.count(" step 3 loss ") == 4, log[-3000:]  # 2 ranks, 2 scripts
    _assert_trained_alike(tmp_path / "ddp.pt", _one_process("mlp", 4))
    _assert_trained_alike(tmp_path / "fsdp.pt", _one_process("transformer", 4))
    assert log.count("collectives ok") == 2, log[-3000:]
    assert log.count("again ok") == 2, log[-3000:]  # (a group made again at once)
    # (the ranks' lines may interleave in torchrun's output: each object found where it is)
    rows = [json.loads(m) for m in re.findall(r'\{"rank": [^{}]*\}', log)]
    traffic = [r for r in rows if "grad_bytes" in r]
    assert len(traffic) == 2, log[-3000:]
    for row in traffic:
        assert row["bytes_sent"] < row["grad_bytes"] / 20, row
        assert row["bytes_received"] < 1024, row  # the loss (and replies), not gradients
    held = [r for r in rows if "memory_held" in r]
    assert len(held) == 2, log[-3000:]
    for row in held:  # a shard of the parameters and one of the gradients: about one model
        assert row["memory_held"] < 1.1 * row["memory_whole"], row  # (unsharded: 2 models)


def test_a_proxy_killed_mid_training_fails_every_rank_within_the_timeout() -> None:
    """Rank 1 kills its own proxy at step 2: both ranks get a clear error (rank 1: its
    connection; rank 0: the all-reduce its proxy could not finish) well within the group's
    timeout, and nothing hangs."""
    started = [LocalProxy("tcp", "numpy", ("--quiet",)) for _ in range(2)]
    try:
        for p in started:
            with _one_thread():
                p.start()
        pids = ",".join(str(p.proc.pid) for p in started if p.proc is not None)
        t0 = time.monotonic()
        log = _torchrun(
            started,
            str(WORKER),
            "kill",
            timeout=90,
            GPUREMOTE_TEST_PROXY_PIDS=pids,
            GPUREMOTE_TEST_DIST_TIMEOUT="20",
            GPUREMOTE_TEST_EXPECT_FAILURE="1",
        )
        elapsed = time.monotonic() - t0
    finally:
        for p in started:
            p.stop()
    # (each rank's message whole, wherever the ranks' lines interleave)
    assert re.search(r"rank 1 error after [\d.]+s: connection to \S+ lost", log), log[-3000:]
    assert re.search(
        r"rank 0 error after [\d.]+s: asynchronous call #\d+ dist_run\(op='all_reduce'\) "
        r"failed on the proxy",
        log,
    ), log[-3000:]
    assert "finished without an error" not in log
    assert elapsed < 60, elapsed


def test_a_hostile_rank_is_refused(proxies: list[LocalProxy]) -> None:
    """A job's group is joined only with its key, at a store on the proxy or a peer, once
    per rank; a session makes a bounded number of stores, with sane timeouts; a collective
    names only the session's own groups and buffers; the proxy goes on serving the job."""
    a, b, c = (SyncDriver(u) for u in (proxies[0].url, proxies[1].url, proxies[0].url))
    try:
        (host, port, key), _ = a.call(_HOST, [2, 20_000])
        with pytest.raises(RemoteCallError, match="no job with this key"):
            c.call(_JOIN, [1, host, port, "0" * 32, 1, 2, 20_000])
        with pytest.raises(RemoteCallError, match="neither this proxy nor one of its peers"):
            c.call(_JOIN, [1, "192.0.2.1", port, key, 1, 2, 20_000])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            joins = [
                pool.submit(d.call, _JOIN, [7, host, port, key, r, 2, 20_000])
                for r, d in enumerate((a, b))
            ]
            for f in joins:
                f.result(timeout=60)
        with pytest.raises(RemoteCallError, match="rank 1 of this job has joined already"):
            c.call(_JOIN, [7, host, port, key, 1, 2, 20_000])
        with pytest.raises(RemoteCallError, match="a job's timeout is 100 ms"):
            c.call(_HOST, [2, 5])
        for _ in range(16):  # stores are a session's to make, up to a limit
            c.call(_HOST, [2, 20_000])
        with pytest.raises(RemoteCallError, match="hosts 16 job stores, the most"):
            c.call(_HOST, [2, 20_000])

        def buffer(d: SyncDriver, n: int = 4) -> list[object]:
            handle = d.session.new_handle()
            d.post(_ALLOC, 0, [handle, 4 * n])
            return [handle, 0, [n], [1], "float32"]

        mine = buffer(c)
        c.post(_RUN, 0, ["all_reduce", 7, [mine], {}])  # the job's group is not c's
        with pytest.raises(RemoteCallError, match="joined no group 7"):
            c.call(_SYNC, [])
        theirs = buffer(b)
        a.post(_RUN, 0, ["all_reduce", 7, [theirs], {}])  # a handle of b's session
        with pytest.raises(RemoteCallError, match="unknown buffer handle"):
            a.call(_SYNC, [])
        # the job's group still works
        bufs = [buffer(d) for d in (a, b)]
        for d, t in zip((a, b), bufs, strict=True):
            d.post(_RUN, 0, ["all_reduce", 7, [t], {}])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(d.call, _SYNC, []) for d in (a, b)]:
                f.result(timeout=60)
    finally:
        for d in (a, b, c):
            d.close()


@pytest.mark.slow
def test_ddp_under_torchrun_on_a_pool(ray_address: str, tmp_path: Path) -> None:
    """``GPUREMOTE_URL=pool://NAME``: rank 0 places the job's 2 ranks on the pool's 2
    proxies (peers of each other, so the job's store on one is allowed to the other); the
    weights equal one process's on the global batch."""
    import gpuremote.pool as gr

    pool = gr.start_pool(2, name="test-ddp", num_gpus=0, backend="numpy")
    try:
        pool.wait_ready()
        out = tmp_path / "weights.pt"
        args = [str(EXAMPLE), "--steps", "3", "--out", str(out)]
        _torchrun([], *args, GPUREMOTE_URL=pool.url, RAY_ADDRESS=ray_address)
        _assert_trained_alike(out, _one_process("mlp", 3))
        served = sorted(r["sessions"] for r in pool.status())
    finally:
        pool.stop()
    assert served == [0, 0], served  # the ranks' sessions ended
