"""``torch.distributed`` on gpuremote devices: the process-group backend ``gpuremote``.

.. code-block:: python

    import torch.distributed as dist
    import gpuremote.torch  # registers the backend

    dist.init_process_group("gpuremote")           # under torchrun: one process per rank
    model = DDP(MyModel().to("gpuremote"))

Each rank's process drives one remote device (``gpuremote:0``), on the proxy its URL names:
``GPUREMOTE_URL`` (or the config file) may list one proxy per rank, comma-separated (rank ``r``
uses the ``r``-th, modulo their number), or name a pool (``pool://NAME``: rank 0 places the
job's ranks on different proxies of the pool). A rank whose device is connected already
(``gt.connect``) keeps its session.

The collectives run **between the proxies holding the tensors** (``gpuremote.proxy.
collectives``): the proxies of the job form their own group (Gloo between CPU proxies, NCCL
between GPU proxies), whose rendezvous store rank 0's proxy hosts; the clients' store (the one
``init_process_group`` uses, e.g. torchrun's) carries only its address and key. A client
queues each collective as one ASYNC call in its session's stream, so it does not wait for it:
the ops after it run after it on the proxy, and a collective that fails (a peer lost, the
group's timeout) fails the rank's next synchronising call, naming it. Tensors never cross a
client: bytes through the client per DDP step are the commands' only (``bytes_sent``).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ..config import resolve_url, url_for_rank
from ..core.driver import SyncDriver
from ..wire.calls import CALLS_BY_NAME
from ._backend import dispatcher, open_driver
from ._tensors import DEVICE, describe

__all__ = ["BACKEND", "ProcessGroupGpuremote", "register_backend"]

log = logging.getLogger("gpuremote.torch.distributed")

#: the backend's name (``dist.init_process_group("gpuremote")``)
BACKEND = "gpuremote"
_HOST, _JOIN, _RUN, _LEAVE = (
    CALLS_BY_NAME[n] for n in ("dist_host", "dist_join", "dist_run", "dist_leave")
)
_SYNC = CALLS_BY_NAME["device_synchronize"]
_STORE_KEY = "gpuremote/job"
_MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000
_DEVICES_KEY = "gpuremote/devices"
#: the most tensors one ``dist_run`` names (the wire's list limit, with room for the input)
_MOST = 63
_REDUCE = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}
_group_ids = itertools.count(1)
#: a Work whose future is one of ours (torch's Python process groups make theirs so)
_c10d: Any = torch._C._distributed_c10d
_create_work_from_future: Callable[[Any], Any] = _c10d._create_work_from_future


def _rank_driver(store: Any, rank: int, size: int) -> SyncDriver:
    """The session serving this rank's device: the one connected already, else one opened
    on this rank's proxy (see the module docstring)."""
    d = dispatcher.drivers.get(0)
    if d is not None and not d.closed:
        return d
    from ..session.opener import devices_now, names_group

    url = resolve_url()
    options: dict[str, Any] = {}
    if names_group(url):  # a pool: rank 0 places the job's ranks on its proxies
        if rank == 0:
            urls, options = devices_now(url, size, {})
            store.set(_DEVICES_KEY, "\n".join(urls))
        else:
            _, options = devices_now(url, 1, {})  # (the pool's secret)
        url = store.get(_DEVICES_KEY).decode().split("\n")[rank]
    else:
        url = url_for_rank(url, rank)
    driver = open_driver(url, None, options)
    dispatcher.drivers[0] = driver
    return driver


#: (typed as Any: the collectives' Python spellings differ from the C++ stubs' overloads)
_ProcessGroup: Any = dist.ProcessGroup


class ProcessGroupGpuremote(_ProcessGroup):
    """One rank of a job on gpuremote devices (see the module docstring); made by
    ``dist.init_process_group("gpuremote")`` (or ``dist.new_group``)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._name = self._desc = ""
        self._left = False
        self._driver = _rank_driver(store, rank, size)
        self._id = next(_group_ids)
        # (the proxy takes 0.1 s to a week: a longer timeout, as some scripts give, is a week)
        self._timeout_ms = min(max(100, int(timeout.total_seconds() * 1e3)), _MAX_TIMEOUT_MS)
        # the job's address, under a key of this group's own: each rank counts the groups
        # it has made with this store (every member makes the same ones, in the same order),
        # so that a rank quick to make the next group (after ``destroy_process_group``, in a
        # store torch reuses) never reads the address of the one before
        made = store.add(f"{_STORE_KEY}/made/{rank}", 1)
        self._store_key = f"{_STORE_KEY}/{made}"
        if rank == 0:
            (host, port, key), _ = self._driver.call(_HOST, [size, self._timeout_ms])
            store.set(self._store_key, f"{host}\n{port}\n{key}")
        host, port, key = store.get(self._store_key).decode().split("\n")
        self._store = store  # (rank 0 takes the job's address off it when the group ends)
        self._driver.call(_JOIN, [self._id, host, int(port), key, rank, size, self._timeout_ms])

    # -- what torch asks of a process group -------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def size(self) -> int:
        return self._size

    # (torch keeps a group's name on its engines; this group is its own engine)
    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def rank(self) -> int:
        return self._rank

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        params = {"reduce": _reduction(opts)}
        return self._work(
            "all_reduce", lambda: self._chunked("all_reduce", tensors, params), tensors
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        params = {"root": int(getattr(opts, "rootRank", 0))}
        return self._work("broadcast", lambda: self._chunked("broadcast", tensors, params), tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        params = {"reduce": _reduction(opts), "root": int(getattr(opts, "rootRank", 0))}
        return self._work("reduce", lambda: self._chunked("reduce", tensors, params), tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        def run() -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                self._run("all_gather", [inp, *out], {})

        return self._work("all_gather", run, outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._pairwise("all_gather_into_tensor", [input], [output], {})

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._pairwise("all_gather_into_tensor", inputs, outputs, {})

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        params = {"reduce": _reduction(opts)}

        def run() -> None:
            for out, ins in zip(outputs, inputs, strict=True):
                self._run("reduce_scatter", [*ins, out], params)

        return self._work("reduce_scatter", run, outputs)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        return self._pairwise(
            "reduce_scatter_tensor", [input], [output], {"reduce": _reduction(opts)}
        )

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._pairwise(
            "reduce_scatter_tensor", inputs, outputs, {"reduce": _reduction(opts)}
        )

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> Any:
        params = {"out_splits": list(output_splits), "in_splits": list(input_splits)}
        return self._pairwise("all_to_all_single", [input], [output], params)

    all_to_all_single = alltoall_base

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        params = {"root": int(getattr(opts, "rootRank", 0))}

        def run() -> None:
            for i, inp in enumerate(inputs):
                self._run("gather", [inp, *(outputs[i] if outputs else [])], params)

        return self._work("gather", run, outputs)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        params = {"root": int(getattr(opts, "rootRank", 0))}

        def run() -> None:
            for i, out in enumerate(outputs):
                self._run("scatter", [*(inputs[i] if inputs else []), out], params)

        return self._work("scatter", run, outputs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        params = {"peer": int(dst), "tag": int(tag)}
        return self._work("send", lambda: self._each("send", tensors, params), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        params = {"peer": int(src), "tag": int(tag)}
        return self._work("recv", lambda: self._each("recv", tensors, params), tensors)

    def barrier(self, opts: Any = None) -> Any:
        def run() -> None:
            self._driver.post(_RUN, 0, ["barrier", self._id, [], {}])
            self._driver.call(_SYNC, [])  # a barrier waits: until every rank's proxy is there

        return self._work("barrier", run, [])

    # -- how a collective is sent ----------------------------------------------------------
    def _work(self, what: str, run: Callable[[], None], result: Any) -> Any:
        """A Work whose future holds ``result`` once ``run`` has queued the collective (it
        runs on the proxies in stream order). An error is the future's (and logged: torch
        drops the exceptions of a process group's methods called from autograd's thread)."""
        future: Future[Any] = Future()
        try:
            run()
        except BaseException as exc:
            log.error("gpuremote: %s of rank %d failed: %s", what, self._rank, exc)
            future.set_exception(exc)
        else:
            future.set_result(result)
        return _create_work_from_future(future)

    def _pairwise(
        self,
        op: str,
        inputs: Sequence[torch.Tensor],
        outputs: list[torch.Tensor],
        params: dict[str, Any],
    ) -> Any:
        """``op`` on each (input, output) pair, one ``dist_run`` each (the tensor-shaped
        collectives, alone or coalesced); the Work's result is ``outputs``."""

        def run() -> None:
            for inp, out in zip(inputs, outputs, strict=True):
                self._run(op, [inp, out], params)

        return self._work(op, run, outputs)

    def _chunked(self, op: str, tensors: Sequence[torch.Tensor], params: dict[str, Any]) -> None:
        for i in range(0, len(tensors), _MOST):
            self._run(op, list(tensors[i : i + _MOST]), params)

    def _each(self, op: str, tensors: Sequence[torch.Tensor], params: dict[str, Any]) -> None:
        for t in tensors:  # (a point-to-point call moves one tensor)
            self._run(op, [t], params)

    def _run(self, op: str, tensors: list[torch.Tensor], params: dict[str, Any]) -> None:
        """Queue one ``dist_run``; CPU tensors go to the device and back (a collective on
        host tensors: its results are read back, so it waits)."""
        host = [(i, t) for i, t in enumerate(tensors) if t.device.type != DEVICE]
        remote = list(tensors)
        for i, t in host:
            if t.device.type != "cpu":
                raise RuntimeError(
                    f"gpuremote: a collective takes {DEVICE} or CPU tensors, not {t.device}"
                )
            remote[i] = t.to(DEVICE)
        self._driver.post(_RUN, 0, [op, self._id, [describe(t) for t in remote], params])
        for i, t in host:
            t.copy_(remote[i].cpu())

    def shutdown(self) -> None:
        """``dist.destroy_process_group()``: wait until every rank's proxy has finished the
        group's collectives (a barrier: a proxy that left while a peer still read from it
        would fail that peer's last collective), then leave the group."""
        if self._driver.closed or self._left:
            return
        self._left = True
        self._driver.post(_RUN, 0, ["barrier", self._id, [], {}])
        self._driver.post(_LEAVE, 0, [self._id])
        try:
            self._driver.call(_SYNC, [])
        except Exception as exc:  # a peer is gone: said, not raised over the error before
            log.warning("gpuremote: rank %d left its group after an error: %s", self._rank, exc)
        if self._rank == 0:  # (every rank read it before joining)
            with contextlib.suppress(Exception):
                self._store.delete_key(self._store_key)

    def __repr__(self) -> str:
        return f"<ProcessGroupGpuremote rank {self._rank} of {self._size} on {self._driver.url}>"


def _reduction(opts: Any) -> str:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for known, name in _REDUCE.items():
        if op == known:
            return name
    raise RuntimeError(f"gpuremote: reduction {op} is not supported")


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    return ProcessGroupGpuremote(store, rank, size, timeout)


_registered = False


def register_backend() -> None:
    """Make ``gpuremote`` a ``torch.distributed`` backend (idempotent; ``import
    gpuremote.torch`` does it)."""
    global _registered
    if _registered or BACKEND.upper() in dist.Backend._plugins:
        _registered = True
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", DEVICE])
    _registered = True
