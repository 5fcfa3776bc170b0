"""Prometheus metrics of a proxy (the ``[metrics]`` extra: prometheus-client).

A collector reads the proxy's snapshot on each scrape, on the proxy's own event loop (the
HTTP server runs in a thread of its own), so serving metrics costs the hot path nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError

__all__ = ["ProxyCollector", "start_metrics_server"]


class ProxyCollector:
    """Turns ``Proxy.snapshot()`` into Prometheus metric families."""

    def __init__(self, proxy: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._proxy = proxy
        self._loop = loop

    async def _snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = self._proxy.snapshot()
        return snap

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop).result(timeout=10)
        labels = ["session", "peer"]
        calls = CounterMetricFamily(
            "gpuremote_calls", "API calls by class", labels=[*labels, "class"]
        )
        counters = {
            "frames_in": ("gpuremote_frames_received", "Frames received from the client"),
            "frames_out": ("gpuremote_frames_sent", "Frames sent to the client"),
            "bytes_in": ("gpuremote_received_bytes", "Bytes received from the client"),
            "bytes_out": ("gpuremote_sent_bytes", "Bytes sent to the client"),
            "failed": ("gpuremote_failed_calls", "Calls that failed on the proxy"),
        }
        gauges = {
            "device_bytes": ("gpuremote_device_memory_bytes", "Device memory the session holds"),
            "buffers": ("gpuremote_buffers", "Device buffers the session holds"),
            "queued_calls": ("gpuremote_queued_calls", "Calls received and not yet run"),
            "pending_bytes_out": ("gpuremote_pending_reply_bytes", "Reply bytes not yet sent"),
            "uptime_s": ("gpuremote_session_uptime_seconds", "Seconds since the client connected"),
        }
        cfam = {k: CounterMetricFamily(n, d, labels=labels) for k, (n, d) in counters.items()}
        gfam = {k: GaugeMetricFamily(n, d, labels=labels) for k, (n, d) in gauges.items()}
        lat = GaugeMetricFamily(
            "gpuremote_sync_latency_seconds",
            "Proxy time to answer frames with SYNC calls (recent)",
            labels=[*labels, "quantile"],
        )
        for s in snap["sessions"]:
            lv = [str(s["session"]), s["peer"]]
            for cls, n in s["calls"].items():
                calls.add_metric([*lv, cls], n)
            for k, fam in cfam.items():
                fam.add_metric(lv, s[k])
            for k, gfa in gfam.items():
                gfa.add_metric(lv, s[k])
            for q, key in (("0.5", "p50"), ("0.99", "p99")):
                v = s["sync_latency_us"][key]
                if v is not None:
                    lat.add_metric([*lv, q], v / 1e6)
        yield calls
        yield from cfam.values()
        yield from gfam.values()
        yield lat
        yield GaugeMetricFamily(
            "gpuremote_sessions", "Connected clients", value=len(snap["sessions"])
        )
        yield CounterMetricFamily(
            "gpuremote_sessions_served", "Clients served since start", value=snap["sessions_served"]
        )
        conns = snap.get("connections", {})
        yield CounterMetricFamily(
            "gpuremote_connections_refused",
            "Connections refused: --max-clients reached",
            value=conns.get("refused", 0),
        )
        yield CounterMetricFamily(
            "gpuremote_handshake_timeouts",
            "Connections closed for not completing the handshake in time",
            value=conns.get("handshake_timeouts", 0),
        )
        backend = snap["backend"]
        info = GaugeMetricFamily(
            "gpuremote_backend_info", "The proxy's backend", labels=["backend", "device"]
        )
        info.add_metric([backend["backend"], backend["device"]], 1)
        yield info


def start_metrics_server(proxy: Any, host: str, port: int) -> str:
    """Serve ``proxy``'s metrics at ``http://host:port/metrics``; returns that URL."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise ConfigError(
            "metrics need prometheus-client: pip install 'gpuremote[metrics]'"
        ) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProxyCollector(proxy, asyncio.get_running_loop()))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return f"http://{host}:{server.server_port}/metrics"
