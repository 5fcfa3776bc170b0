"""Start a proxy in a child process on a free loopback port (for the demo and the benches)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

from ..errors import GpuRemoteError

__all__ = ["LocalProxy"]

READY = "gpuremote proxy listening on "


class LocalProxy:
    """``with LocalProxy("tcp") as p: p.url``: a proxy process, stopped on exit.

    A ucx:// proxy listens on every interface (ucxx binds no one address), so it needs a
    shared secret: where none is set, ``start`` makes one and sets ``GPUREMOTE_SECRET`` in
    this process (for its clients, and the proxy) until ``stop``."""

    def __init__(
        self,
        transport: str = "tcp",
        backend: str = "auto",
        extra_args: tuple[str, ...] = (),
        cpus: set[int] | None = None,
    ) -> None:
        self.transport = transport
        self.backend = backend
        self.extra_args = extra_args
        self.cpus = cpus  # the CPUs the process may run on, from its start
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.banner = ""
        self._made_secret = False

    def _ensure_secret(self) -> None:
        from ..wire.auth import load_secret

        if (
            "ucx" in self.transport
            and load_secret() is None
            and "--insecure" not in self.extra_args
        ):
            os.environ["GPUREMOTE_SECRET"] = secrets.token_hex(32)
            self._made_secret = True

    def start(self, timeout: float = 30.0) -> str:
        self._ensure_secret()
        listen = f"{self.transport}://127.0.0.1:0"
        launcher = [sys.executable, "-m", "gpuremote"]
        if self.cpus is not None:  # pinned before anything starts (BLAS sizes its pool then)
            launcher = [
                sys.executable,
                "-c",
                f"import os, sys; os.sched_setaffinity(0, {sorted(self.cpus)}); "
                "os.execv(sys.executable, [sys.executable, '-m', 'gpuremote', *sys.argv[1:]])",
            ]
        cmd = [
            *launcher,
            "serve",
            "--listen",
            listen,
            "--backend",
            self.backend,
            "--announce",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, text=True, stderr=subprocess.DEVNULL, env=os.environ.copy()
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(READY):
                self.url = line[len(READY) :].split()[0]
                self.banner = line.strip()
                return self.url
        self.stop()
        raise GpuRemoteError(f"the local proxy did not start ({' '.join(cmd)})")

    def stop(self) -> int | None:
        if self._made_secret:
            self._made_secret = False
            os.environ.pop("GPUREMOTE_SECRET", None)
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def __enter__(self) -> LocalProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
