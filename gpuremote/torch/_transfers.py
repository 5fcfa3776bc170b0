"""Copies between the host and the ``gpuremote`` device, and between two remote tensors
(``_copy_from``, which ATen calls for every copy a device does not make itself)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..core.driver import SyncDriver
from ..errors import PeerUnreachable, RemoteCallError
from ..wire.calls import BUFFER, CALLS_BY_NAME
from ._tensors import byte_desc, contiguous_strides, describe, is_remote

__all__ = ["Transfers"]

_COPY = torch.ops.aten.copy_.default
_ATEN, _H2D, _D2H = CALLS_BY_NAME["aten"], CALLS_BY_NAME["copy_h2d"], CALLS_BY_NAME["copy_d2h"]
_EXPORT, _IMPORT, _PEER_READ = (
    CALLS_BY_NAME["peer_export"],
    CALLS_BY_NAME["peer_import"],
    CALLS_BY_NAME["peer_read"],
)


class _Devices(Protocol):
    """What copies need of the device's kernels: each index's session, new buffers."""

    def driver(self, index: int | None) -> SyncDriver: ...
    def run(
        self, op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...
    def empty(
        self, sizes: Any, strides: Any, dtype: torch.dtype | None, device: torch.device | None
    ) -> torch.Tensor: ...


class Transfers:
    """The device's copies: host to device (``copy_h2d``, ASYNC), device to host
    (``copy_d2h``, SYNC), on one device (the ATen ``copy_`` on the proxy), between two
    devices (proxy to proxy)."""

    def __init__(self, devices: _Devices) -> None:
        self._devices = devices
        #: copies between two devices: proxy to proxy, and through the client
        self.proxy_to_proxy = 0
        self.through_client = 0

    def copy_from(self, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> Any:
        """``dst.copy_(src)`` where one of them is remote. Either may carry PyTorch's lazy
        conjugate or negative bit (``x.conj()``, ``torch._neg_view``): the proxy's views of
        a buffer are its bytes, so the values are made physical here, as ATen's own copy
        does on the CPU and CUDA."""
        if is_remote(dst) and is_remote(src) and dst.device == src.device:
            if not (src.is_conj() or dst.is_conj() or src.is_neg() or dst.is_neg()):
                # the ATen op as any other: by its template from its signature's second call
                return self._devices.run(_COPY, (dst, src), {})
            d = self._devices.driver(dst.device.index)
            written = [describe(dst)]
            d.post(_ATEN, 0, ["copy_.default", [written[0], describe(src)], _DST_SRC, []])
            if src.is_conj() != dst.is_conj():
                d.post(_ATEN, 0, ["conj_physical_.default", written, _SELF, []])
            if src.is_neg() != dst.is_neg():
                d.post(_ATEN, 0, ["neg_.default", written, _SELF, []])
            return dst
        if is_remote(dst) and is_remote(src):
            return self._between_devices(src, dst)
        if is_remote(dst):  # from the host
            host = src.to("cpu") if is_remote(src) else src
            host = host.resolve_conj().resolve_neg()
            host = host.to(dst.dtype).expand(dst.shape).contiguous()
            if host.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
                host = host.clone()  # the caller may change (or resize) src before it is sent
            d = self._devices.driver(dst.device.index)
            if dst.is_contiguous():
                target = dst
                if dst.is_conj():  # the bytes of dst hold the conjugate of its values
                    host = host.conj_physical()
                if dst.is_neg():
                    host = host.neg()
            else:
                target = self._devices.empty(
                    list(dst.shape), contiguous_strides(dst.shape), dst.dtype, dst.device
                )
            data = host.reshape(-1).view(torch.uint8).numpy()
            if data.nbytes:
                d.post(_H2D, 0, [byte_desc(target), BUFFER], data.data)
            if target is not dst:
                self.copy_from(target, dst)
            return dst
        # to the host
        d = self._devices.driver(src.device.index)
        if not src.is_contiguous():
            src = src.contiguous()  # on the proxy
        if src.numel() == 0:
            return dst
        _, buffers = d.call(_D2H, [byte_desc(src)])
        got = buffers[0]
        host = torch.frombuffer(bytearray(got) if got.readonly else got, dtype=torch.uint8)
        host = host.view(src.dtype).reshape(src.shape)
        if src.is_conj():  # the bytes are the conjugate of the values
            host = host.conj()
        if src.is_neg():
            host = torch._neg_view(host)
        dst.copy_(host)
        return dst

    def _between_devices(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """``dst.copy_(src)`` between two devices: proxy to proxy (``peer_export`` on the
        source's, ``peer_import`` on the target's: the data never comes to the client),
        else, where the target's proxy cannot reach the source's, through the client."""
        data = src.resolve_conj().resolve_neg()  # these ops run on the source's device
        if data.dtype != dst.dtype:
            data = data.to(dst.dtype)
        if dst.is_conj():  # the bytes of dst hold the conjugate of its values
            data = data.conj_physical()
        if dst.is_neg():
            data = data.neg()
        data = data.expand(dst.shape).contiguous()
        if data.numel() == 0:
            return dst
        sd = self._devices.driver(src.device.index)
        dd = self._devices.driver(dst.device.index)
        target = dst
        if not dst.is_contiguous():
            target = self._devices.empty(
                list(dst.shape), contiguous_strides(dst.shape), dst.dtype, dst.device
            )
        ticket, _ = sd.call(_EXPORT, [byte_desc(data)])
        try:
            dd.call(_IMPORT, [byte_desc(target), sd.url, ticket])
            self.proxy_to_proxy += 1
        except RemoteCallError as exc:
            if not exc.is_a(PeerUnreachable):
                raise
            value, buffers = sd.call(_PEER_READ, [ticket])
            dd.post(_H2D, 0, [byte_desc(target), BUFFER], buffers[value])
            self.through_client += 1
        if target is not dst:
            self.copy_from(target, dst)
        return dst


#: the encoded arguments of ``copy_(dst, src)`` and of an op on one tensor
_DST_SRC: list[Any] = [[{"t": 0}, {"t": 1}], {}]
_SELF: list[Any] = [[{"t": 0}], {}]
