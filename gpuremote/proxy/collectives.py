"""Collectives between proxies: the process groups that the proxies of one distributed job
form, so that a job's all-reduce runs where its tensors are, never through a client.

The engine is ``torch.distributed``'s own: Gloo between CPU proxies, NCCL between GPU proxies.
A job's group forms in two steps, both asked by the job's clients (``gpuremote.torch.
distributed``):

- ``dist_host`` (rank 0's proxy): starts a ``TCPStore`` for the job on this proxy (listening
  on the proxy's own address) and answers its address and a new job key (128 random bits).
  Every key of the job's rendezvous lives under that key, so only its holders can find the
  job, let alone join it.
- ``dist_join`` (every rank's proxy): connects to the store (on this proxy or a peer's: a
  client cannot make a proxy dial anywhere else), claims its rank (a rank is claimed once: a
  second claim is refused) and makes the group; Gloo's rendezvous waits for the other ranks,
  bounded by the job's timeout.

Then ``dist_run`` runs one collective of a group the session joined on views of its own
buffers, in order on the session's stream; a group is the session's (another session cannot
name it), and a failed collective breaks the group (a peer gone, a timeout): later ones fail at
once, naming the first failure. The groups of a session are torn down when it ends.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COLLECTIVES",
    "MAX_GROUPS",
    "MAX_RANKS",
    "MAX_STORES",
    "REDUCE_OPS",
    "CollectiveFailed",
    "Collectives",
    "Group",
]

#: the collectives ``dist_run`` runs; its tensors are the inputs, then the outputs:
#: in place (all_reduce, broadcast, reduce: the tensors), [input, output_0 .. output_{k-1}]
#: (all_gather; gather on its root, [input] elsewhere), [input_0 .. input_{k-1}, output]
#: (reduce_scatter; scatter on its root, [output] elsewhere), [input, output] (the
#: tensor-shaped ones), [tensor] (send and recv, to or from rank ``peer``, with ``tag``)
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
)
#: the most ranks a job may have
MAX_RANKS = 65536
#: the most job stores one session may host, and groups it may be in, at once
MAX_STORES = 16
MAX_GROUPS = 64
#: reductions by name (``avg``: a sum divided by the group's size, as Gloo has no average)
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
_JOB = "gpuremote/job/"


class CollectiveFailed(Exception):
    """A group cannot be formed, or a collective cannot run (the message says why)."""


@dataclass(slots=True)
class Group:
    """One session's process group: its rank among ``size``, the engine's group, and the
    first failure that broke it."""

    pg: Any
    rank: int
    size: int
    backend: str
    timeout_s: float
    job: str
    broken: str = ""
    calls: int = 0
    nbytes: int = 0


class Collectives:
    """The process groups (and job stores) of every session of one proxy (thread-safe).

    ``own_hosts()`` gives the hosts this proxy listens on, ``peer_hosts()`` those of the
    proxies it may reach: a job's store must be on one of them."""

    def __init__(
        self,
        own_hosts: Callable[[], Sequence[str]],
        peer_hosts: Callable[[], Sequence[str]],
    ) -> None:
        self._own_hosts = own_hosts
        self._peer_hosts = peer_hosts
        self._lock = threading.Lock()
        #: session -> the job stores it hosts (with their listening sockets)
        self._stores: dict[int, list[tuple[Any, socket.socket]]] = {}
        self._groups: dict[tuple[int, int], Group] = {}  # (session, group id) -> group

    # -- forming a group -------------------------------------------------------------------
    def host(self, session: int, size: int, timeout_s: float) -> list[Any]:
        """Start a job's store (for ``size`` ranks); returns [host, port, key]."""
        dist = _dist()
        if not 1 <= size <= MAX_RANKS:
            raise CollectiveFailed(f"a job has 1 to {MAX_RANKS} ranks, not {size}")
        with self._lock:
            if len(self._stores.get(session, ())) >= MAX_STORES:
                raise CollectiveFailed(f"this session hosts {MAX_STORES} job stores, the most")
        hosts = [h for h in self._own_hosts() if h not in ("", "0.0.0.0", "::")]
        host = hosts[0] if hosts else "127.0.0.1"
        # the store listens on this proxy's address alone (on its own, on every interface)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.bind((host, 0))
            sock.listen(128)
            store = dist.TCPStore(
                host,
                sock.getsockname()[1],
                None,
                True,
                datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
                master_listen_fd=sock.fileno(),
            )
        except Exception as exc:
            sock.close()
            raise CollectiveFailed(f"cannot start the job's store: {_first_line(exc)}") from None
        key = secrets.token_hex(16)
        store.set(f"{_JOB}{key}/size", str(size))
        with self._lock:
            self._stores.setdefault(session, []).append((store, sock))
        return [host, int(store.port), key]

    def join(
        self,
        session: int,
        group_id: int,
        host: str,
        port: int,
        key: str,
        rank: int,
        size: int,
        timeout_s: float,
        device: Any,
    ) -> Group:
        """Join ``session`` to the job ``key`` names as ``rank`` of ``size`` (see the module
        docstring); blocks until every rank has joined or ``timeout_s`` passed."""
        dist = _dist()
        allowed = {*self._own_hosts(), *self._peer_hosts()}
        if host not in allowed:
            raise CollectiveFailed(
                f"the job's store at {host} is on neither this proxy nor one of its peers"
            )
        if not 0 <= rank < size <= MAX_RANKS:
            raise CollectiveFailed(f"rank {rank} is not one of a group of {size}")
        if not 0 < port < 65536:
            raise CollectiveFailed(f"port {port} is not a TCP port")
        with self._lock:
            if (session, group_id) in self._groups:
                raise CollectiveFailed(f"this session is in group {group_id} already")
            if sum(1 for k in self._groups if k[0] == session) >= MAX_GROUPS:
                raise CollectiveFailed(f"this session is in {MAX_GROUPS} groups, the most")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, None, False, timeout)
        except Exception as exc:  # (torch's DistNetworkError, RuntimeError)
            raise CollectiveFailed(
                f"cannot reach the job's store at {host}:{port}: {exc}"
            ) from None
        job = f"{_JOB}{key}/"
        if not store.check([f"{job}size"]):
            raise CollectiveFailed("no job with this key at the store")
        expected = int(store.get(f"{job}size"))
        if expected != size:
            raise CollectiveFailed(f"the job has {expected} ranks, not {size}")
        if store.add(f"{job}rank/{rank}", 1) != 1:
            raise CollectiveFailed(f"rank {rank} of this job has joined already")
        backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
        pg_store = dist.PrefixStore(f"{job}pg", store)
        try:
            pg = _make_group(dist, backend, pg_store, rank, size, timeout, self._own_hosts())
        except Exception as exc:
            raise CollectiveFailed(f"the job's group did not form: {_first_line(exc)}") from None
        group = Group(pg, rank, size, backend, timeout_s, key)
        with self._lock:
            self._groups[(session, group_id)] = group
        return group

    # -- running ---------------------------------------------------------------------------
    def group(self, session: int, group_id: int) -> Group:
        """The session's group ``group_id``."""
        g = self._groups.get((session, group_id))
        if g is None:
            raise CollectiveFailed(f"this session has joined no group {group_id}")
        return g

    def run(self, group: Group, op: str, tensors: Sequence[Any], params: dict[str, Any]) -> None:
        """Run collective ``op`` of ``group`` on ``tensors`` (torch tensors of the session's
        buffers) and wait for it; a failure breaks the group."""
        if group.broken:
            raise CollectiveFailed(f"the group failed earlier: {group.broken}")
        dist = _dist()
        # the engines take dense tensors: a strided view runs as a copy, copied back after
        dense = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        work = _start(dist, group, op, dense, params)
        try:
            if work is not None:
                work.wait()
            for t, d in zip(tensors, dense, strict=True):
                if d is not t:
                    t.copy_(d)
        except Exception as exc:
            group.broken = f"{op}: {_first_line(exc)}"
            with contextlib.suppress(Exception):
                group.pg.abort()
            raise CollectiveFailed(
                f"{op} of rank {group.rank} of {group.size} failed: {_first_line(exc)}"
            ) from None
        if op == "all_reduce" and params.get("reduce") == "avg":
            for t in tensors:
                t.div_(group.size)
        elif op in ("reduce_scatter", "reduce_scatter_tensor") and params.get("reduce") == "avg":
            tensors[-1].div_(group.size)
        group.calls += 1
        group.nbytes += sum(t.numel() * t.element_size() for t in tensors)

    # -- the end ---------------------------------------------------------------------------
    def leave(self, session: int, group_id: int) -> None:
        with self._lock:
            g = self._groups.pop((session, group_id), None)
        if g is not None:
            _shut(g)

    def drop_session(self, session: int) -> None:
        """Tear down ``session``'s groups and the stores it hosts (it ended)."""
        with self._lock:
            groups = [g for k, g in self._groups.items() if k[0] == session]
            for k in [k for k in self._groups if k[0] == session]:
                del self._groups[k]
            stores = self._stores.pop(session, [])
        for g in groups:
            _shut(g)
        for store, sock in stores:
            del store
            sock.close()

    def stats(self, session: int) -> list[dict[str, Any]]:
        """The session's groups: rank, size, engine, collectives run, bytes they covered."""
        with self._lock:
            groups = [(k[1], g) for k, g in self._groups.items() if k[0] == session]
        return [
            {
                "group": gid,
                "rank": g.rank,
                "size": g.size,
                "backend": g.backend,
                "collectives": g.calls,
                "bytes": g.nbytes,
                "broken": g.broken,
            }
            for gid, g in groups
        ]


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        raise CollectiveFailed("this proxy's torch has no torch.distributed") from None
    if not dist.is_available():  # pragma: no cover
        raise CollectiveFailed("this proxy's torch has no torch.distributed")
    return dist


def _make_group(
    dist: Any,
    backend: str,
    store: Any,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    hosts: Sequence[str],
) -> Any:
    """The engine's group for one rank (Gloo on the interface of this proxy's address)."""
    if backend == "nccl":  # pragma: no cover - needs GPUs
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    host = next((h for h in hosts if h not in ("", "0.0.0.0", "::")), "")
    if host:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _reduce_op(dist: Any, params: dict[str, Any]) -> Any:
    name = params.get("reduce", "sum")
    if name not in REDUCE_OPS:
        raise CollectiveFailed(f"unknown reduction {name!r}; one of {', '.join(REDUCE_OPS)}")
    if name == "avg":
        name = "sum"
    return getattr(dist.ReduceOp, name.upper())


def _root(params: dict[str, Any], size: int) -> int:
    root = params.get("root", 0)
    if type(root) is not int or not 0 <= root < size:
        raise CollectiveFailed(f"root {root!r} is not a rank of a group of {size}")
    return root


def _start(dist: Any, g: Group, op: str, ts: list[Any], params: dict[str, Any]) -> Any:
    """Start collective ``op`` on the engine's group; returns its Work (None: nothing to do)."""
    pg, size = g.pg, g.size
    if op not in COLLECTIVES:
        raise CollectiveFailed(f"unknown collective {op!r}; one of {', '.join(COLLECTIVES)}")
    if op == "barrier":
        return pg.barrier()
    if not ts:
        raise CollectiveFailed(f"{op} takes at least one tensor")
    if op == "all_reduce":
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(dist, params)
        return pg.allreduce(ts, opts)
    if op == "broadcast":
        opts = dist.BroadcastOptions()
        opts.rootRank = _root(params, size)
        return pg.broadcast(ts, opts)
    if op == "reduce":
        opts = dist.ReduceOptions()
        opts.reduceOp = _reduce_op(dist, params)
        opts.rootRank = _root(params, size)
        return pg.reduce(ts, opts)
    if op == "all_gather":  # [input, output_0 .. output_{k-1}]
        if len(ts) != size + 1:
            raise CollectiveFailed(f"all_gather in a group of {size} takes {size} outputs")
        return pg.allgather([ts[1:]], [ts[0]])
    if op == "all_gather_into_tensor":  # [input, output]
        _pair(op, ts)
        return pg._allgather_base(ts[1], ts[0])
    if op == "reduce_scatter":  # [input_0 .. input_{k-1}, output]
        if len(ts) != size + 1:
            raise CollectiveFailed(f"reduce_scatter in a group of {size} takes {size} inputs")
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _reduce_op(dist, params)
        return pg.reduce_scatter([ts[-1]], [ts[:-1]], opts)
    if op == "reduce_scatter_tensor":  # [input, output]
        _pair(op, ts)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _reduce_op(dist, params)
        return pg._reduce_scatter_base(ts[1], ts[0], opts)
    if op == "gather":  # the root: [input, output_0 .. output_{k-1}]; the others: [input]
        opts = dist.GatherOptions()
        opts.rootRank = root = _root(params, size)
        outs = ts[1:]
        if len(outs) != (size if g.rank == root else 0):
            raise CollectiveFailed(f"gather in a group of {size} takes {size} outputs on its root")
        return pg.gather([outs] if outs else [], [ts[0]], opts)
    if op == "scatter":  # the root: [input_0 .. input_{k-1}, output]; the others: [output]
        opts = dist.ScatterOptions()
        opts.rootRank = root = _root(params, size)
        ins = ts[:-1]
        if len(ins) != (size if g.rank == root else 0):
            raise CollectiveFailed(f"scatter in a group of {size} takes {size} inputs on its root")
        return pg.scatter([ts[-1]], [ins] if ins else [], opts)
    if op in ("send", "recv"):
        peer, tag = params.get("peer"), params.get("tag", 0)
        if type(peer) is not int or not 0 <= peer < size or peer == g.rank:
            raise CollectiveFailed(f"{op}: peer {peer!r} is not another rank of a group of {size}")
        if type(tag) is not int or tag < 0:
            raise CollectiveFailed(f"{op}: tag {tag!r} is not a non-negative integer")
        return (pg.send if op == "send" else pg.recv)(ts, peer, tag)
    # all_to_all_single: [input, output], split sizes in params
    _pair(op, ts)
    return pg.alltoall_base(
        ts[1], ts[0], list(params.get("out_splits", [])), list(params.get("in_splits", []))
    )


def _pair(op: str, ts: list[Any]) -> None:
    if len(ts) != 2:
        raise CollectiveFailed(f"{op} takes [input, output]")


def _shut(g: Group) -> None:
    with contextlib.suppress(Exception):
        g.pg.abort()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
