"""A bare tagged channel on ucx://'s worker-address path, with no framing: the baseline that
``bench`` measures gpuremote's ucx:// against (the same driver, the same endpoints), and a
raw peer for the hostile-input tests. Not used by gpuremote itself."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
from gpuremote.transports.ucx import Done, UcxConnection, get_driver
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array as UcxArray

from gpuremote.errors import ConnectionClosed, ProtocolError
from gpuremote.wire.framing import FrameLimits

__all__ = ["RawUcx", "raw_connect", "raw_listen"]


class RawUcx:
    """A bare tagged channel on the worker-address endpoint of ``conn``."""

    def __init__(self, conn: UcxConnection) -> None:
        tagged = conn.tagged
        if tagged is None:
            raise ConnectionClosed(f"{conn.peer}: no worker-address endpoint")
        self._endpoint, self._tag, self._peer_tag = tagged
        self._conn = conn
        self._driver = conn.driver
        self._keep: dict[int, Any] = {}  # what sends in flight read from
        self._then: Callable[[np.ndarray[Any, Any]], None] | None = None

    def send(self, view: memoryview, done: Done) -> None:
        """Send ``view`` as one message; ``done(exc or None)`` when sent."""
        keep = self._keep
        keep[id(view)] = view

        def sent(exc: BaseException | None, key: int = id(view)) -> None:
            keep.pop(key, None)
            done(exc)

        request = self._endpoint.tag_send(UcxArray(view), self._peer_tag)
        self._driver.track(request, sent, self._conn)

    def recv(self, buf: np.ndarray[Any, Any], done: Done) -> None:
        """Receive the next message, of exactly ``buf``'s size, into ``buf``."""

        def got(exc: BaseException | None, buf: np.ndarray[Any, Any] = buf) -> None:
            done(exc)  # ``buf`` lives here until then: UCX writes into it meanwhile

        request = self._endpoint.tag_recv(UcxArray(buf), self._tag)
        self._driver.track(request, got, self._conn)

    def next_message(self, then: Callable[[np.ndarray[Any, Any]], None]) -> None:
        """``then(message)`` with the next message, whatever its size."""
        self._then = then
        self.probe()

    def probe(self) -> None:
        then, driver, conn = self._then, self._driver, self._conn
        if then is None or conn.closed:
            driver.probers.discard(self)
            return

        def done(exc: BaseException | None, buf: np.ndarray[Any, Any]) -> None:
            if exc is None:
                then(buf)

        self._then = None  # before: ``done`` may run at once, and ask for the next one
        if not driver.take_message(self._tag, self, conn, done):
            self._then = then

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def close(self) -> None:
        self._driver.probers.discard(self)
        self._conn.close()


async def raw_connect(host: str, port: int) -> RawUcx:
    """A ``RawUcx`` channel to a ``raw_listen`` server."""
    driver = get_driver()
    ep = ucx_api.UCXEndpoint.create(driver.worker, host, port, True)
    driver.soon()
    conn = UcxConnection(driver, ep, FrameLimits(), f"{host}:{port}")
    await conn.hello(True, start=False)
    return RawUcx(conn)


async def raw_listen(
    on_channel: Callable[[RawUcx], None], local_only: bool = False
) -> tuple[Any, int]:
    """Accept ``RawUcx`` channels on a free port; returns (the listener, keep it, its port).
    ``local_only``: on the driver of listeners on a loopback address (UCX's transports on the
    host only), as the proxy's own listener there."""
    driver = get_driver(local_only)
    holder: list[Any] = []

    async def serve(conn: UcxConnection) -> None:
        with contextlib.suppress(ConnectionClosed, ProtocolError):
            await conn.hello(True, start=False)
            on_channel(RawUcx(conn))

    def accept(conn_request: Any) -> None:
        ep = holder[0].create_endpoint_from_conn_request(conn_request, True)
        task = asyncio.ensure_future(serve(UcxConnection(driver, ep, FrameLimits(), "raw")))
        holder.append(task)

    def on_request(conn_request: Any, *args: Any) -> None:
        driver.loop.call_soon(accept, conn_request)

    listener = ucx_api.UCXListener.create(driver.worker, 0, on_request)
    holder.insert(0, listener)
    return listener, listener.port
