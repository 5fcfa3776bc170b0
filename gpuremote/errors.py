"""The one family of exceptions that gpuremote raises to its callers.

Local misuse (``LocalProtocolError``) and garbage from the peer (``RemoteProtocolError``) are
different errors, as in h11; a failed remote call is a ``RemoteCallError`` that names the call,
its op and the proxy's message.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "CaptureError",
    "ConfigError",
    "ConnectionClosed",
    "FailoverError",
    "GpuRemoteError",
    "LimitExceeded",
    "LocalProtocolError",
    "PeerNotAllowed",
    "PeerUnreachable",
    "ProtocolError",
    "RemoteCallError",
    "RemoteProtocolError",
    "TransportUnavailable",
    "UnknownHandle",
]


class GpuRemoteError(Exception):
    """Base class of every error gpuremote raises."""


class CaptureError(GpuRemoteError):
    """A step being captured did something a recording cannot hold: it needed data from the
    device, sent host data, or made a stream, event or kernel."""


class ConfigError(GpuRemoteError):
    """A URL, config file or option is invalid."""


class TransportUnavailable(ConfigError):
    """The URL names a transport that is unknown or whose optional extra is not installed."""


class AuthenticationError(GpuRemoteError):
    """The proxy refused this client's credentials, or needs some that the client lacks."""


class ConnectionClosed(GpuRemoteError):
    """The connection is gone (closed by either side, or lost); pending calls fail with this."""


class FailoverError(ConnectionClosed):
    """A session with ``failover`` lost its proxy and could not move to another one, or could
    not restore something (the message names what)."""


class ProtocolError(GpuRemoteError):
    """A frame or message breaks the wire protocol."""


class LocalProtocolError(ProtocolError):
    """This side tried to send something the protocol does not allow (a limit, a bad value)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that are not a valid frame or message; the connection is unusable."""


class LimitExceeded(LocalProtocolError):
    """A hard limit (frame size, buffers, commands, ndim, handles, memory) would be exceeded."""


class PeerUnreachable(GpuRemoteError):
    """A proxy could not, or may not, read from another one (a copy between proxies then goes
    through the client); reported to the client as a ``RemoteCallError`` of this kind."""


class PeerNotAllowed(PeerUnreachable):
    """A proxy may not read from another one: it is not among its peers (``serve --peer``;
    a pool's proxies are each other's)."""


class UnknownHandle(GpuRemoteError):
    """A call named a buffer, stream, event, kernel or recorded step that its session does
    not hold; reported to the client as a ``RemoteCallError`` of this kind."""


#: the errors of the proxy's that a client tells apart, by the ``kind`` it is sent
_KINDS: dict[str, type[GpuRemoteError]] = {
    cls.__name__: cls for cls in (PeerUnreachable, PeerNotAllowed, UnknownHandle)
}


class RemoteCallError(GpuRemoteError):
    """A call failed on the proxy.

    ``call`` and ``op`` name the failing call (``op`` is the launched op or kernel, if any);
    ``seq`` is its sequence number in the session; ``deferred`` is true when the failed call was
    asynchronous and is reported at a later synchronisation point; ``skipped`` counts the calls
    queued after it on the same stream that were not run.
    """

    def __init__(
        self,
        message: str,
        *,
        call: str,
        op: str | None = None,
        seq: int = -1,
        kind: str = "Error",
        deferred: bool = False,
        skipped: int = 0,
    ) -> None:
        self.message = message
        self.call = call
        self.op = op
        self.seq = seq
        self.kind = kind
        self.deferred = deferred
        self.skipped = skipped
        what = f"{call}(op={op!r})" if op else call
        where = f"asynchronous call #{seq} {what}" if deferred else f"call #{seq} {what}"
        text = f"{where} failed on the proxy: {kind}: {message}"
        if skipped:
            text += f" ({skipped} later call(s) on that stream were not run)"
        super().__init__(text)

    def is_a(self, error: type[GpuRemoteError]) -> bool:
        """Whether the proxy reported this failure as ``error`` (or one of its kinds): for
        the proxy's errors a client acts on (``PeerUnreachable``, ``UnknownHandle``)."""
        cls = _KINDS.get(self.kind)
        return cls is not None and issubclass(cls, error)
