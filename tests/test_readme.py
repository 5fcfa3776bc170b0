"""The code blocks of the README and of the documentation site's pages (``docs/``), run as a
new user would run them (on one machine).

Every fenced block of README.md and docs/**/*.md is either run here or named in ``SKIPPED``
with the reason it cannot run on one machine without a GPU; a new block that is neither fails
the test. The
host ``gpu-box`` stands for the user's GPU machine and becomes 127.0.0.1; ports 5151 and 9464
become free ones (``serve``'s default port too); ``BENCH_OPTIONS`` shortens the benchmarks
(their flags as written are kept).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuremote.config import PipelineConfig

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: the pages whose blocks run: the README, then the documentation site's
PAGES = [README, *sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)]


@dataclass
class Block:
    lang: str
    text: str
    line: int
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def skipped(self) -> str | None:
        """Why the block is not run (``SKIPPED``), if it is not."""
        return next((why for start, why in SKIPPED.items() if self.text.startswith(start)), None)


def _blocks() -> list[Block]:
    return [b for page in PAGES for b in _page_blocks(page)]


def _page_blocks(page: Path) -> list[Block]:
    blocks, lines = [], page.read_text().splitlines()
    name = str(page.relative_to(ROOT))
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            start = i
            i += 1
            body = []
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append(Block(m.group(1), "\n".join(body), start + 1, name))
        i += 1
    return blocks


#: blocks that cannot run here as written, by how they start, and why
SKIPPED = {
    "./scripts/demo.sh": (
        "the set-up commands themselves: CI runs scripts/test.sh (which makes the venv that "
        "scripts/demo.sh uses); tests/test_cli.py runs `gpuremote demo` and `bench ping`"
    ),
    "gpuremote bench requirements --transport emu+inproc --backend sim:a100 --quick --json": (
        "the same sweep (the async workloads over emu+inproc on the simulated A100, JSON and "
        "the plot) on a reduced grid, its figures checked: tests/test_profiles.py"
        "::test_bench_requirements_over_emu_inproc_json"
    ),
    "gpuremote bench requirements --transport emu+inproc --backend sim:a100 --workloads gpt2": (
        "the same sweep (GPT-2 on the simulated A100, both modes, the PyTorch baseline beside "
        "the in-process one) on a reduced grid, its figures checked: tests/test_torch_sweep.py"
        "::test_the_requirements_sweep_takes_the_pytorch_workloads"
    ),
    "import ray, gpuremote.pool": (
        "asks Ray for GPUs (num_gpus=1); examples/pool.py is the same without GPUs, and "
        "tests/test_pool.py runs the pool, pool:// and to_device on a local Ray instance"
    ),
    "gpuremote pool start": (
        "asks Ray for GPUs; tests/test_pool.py::test_pool_cli runs pool start, status "
        "(--json and the table), top and stop with --num-gpus 0 --backend numpy"
    ),
    "gpuremote/   __init__.py (the public names)": ("a picture of the layout, not code"),
    "pip install torch==2.13.0": (
        "installs packages: scripts/test.sh installs the same way (torch first, then held "
        "by scripts/constraints.txt while transformers and diffusers install)"
    ),
    "import torch\nimport torch.distributed as dist": (
        "a rank's script, run by torchrun against a proxy per rank: examples/ddp.py is it "
        "whole, and tests/test_distributed.py runs it under torchrun (2 proxies; a Ray pool)"
    ),
    "$ GPUREMOTE_URL=tcp://gpu-a:5151,tcp://gpu-b:5151 torchrun": (
        "torchrun against remote proxies; tests/test_distributed.py runs examples/ddp.py the "
        "same way against local proxies and a local Ray pool"
    ),
    " rank 0 (client)": "a picture of the collectives' path, not code",
    'gpu = await gpuremote.connect("pool://team", failover=True)': (
        "a fragment (awaits outside a coroutine) on a Ray pool; tests/test_failover.py runs "
        "failover over pools and over proxies started by hand"
    ),
}

#: extra options that keep each benchmark short (the README's own flags stay as written)
BENCH_OPTIONS = {
    "ping": ["--count", "30", "--warmup", "3"],
    "throughput": ["--sizes", "64k"],
    "api": ["--calls", "200", "--rounds", "1"],
    "ops": ["--cases", "sync_op", "--iterations", "20", "--rounds", "1", "--warmup", "2"],
    "tenants": ["--seconds", "1"],
    "peer": ["--mib", "2", "--rounds", "1"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Shell:
    """Runs a block's lines in ``cwd``, as a shell would, with the substitutions above."""

    cwd: Path
    ports: dict[str, str] = field(default_factory=dict)
    server: subprocess.Popen[str] | None = None

    def substitute(self, text: str) -> str:
        text = text.replace("gpu-box", "127.0.0.1")
        for old, new in self.ports.items():
            text = text.replace(old, new)
        return text

    def env(self, assignments: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUREMOTE_")}
        env.update(assignments)
        return env

    def run_line(self, line: str) -> None:
        words = shlex.split(self.substitute(line), comments=True)
        if not words:
            return
        assignments = {}
        while "=" in words[0] and not words[0].startswith("-"):
            k, v = words.pop(0).split("=", 1)
            assignments[k] = v
        stdout_file = None
        if ">" in words:
            i = words.index(">")
            stdout_file, words = self.cwd / words[i + 1], words[:i]
        program, *args = words
        if program == "gpuremote":
            argv = [sys.executable, "-m", "gpuremote", *args]
        elif program == "python":
            argv = [sys.executable, *args]
        else:
            pytest.fail(f"README line {line!r}: no rule to run {program!r}")
        if args[:1] == ["serve"]:
            if "--listen" not in args:  # its default, tcp://127.0.0.1:5151, moved likewise
                argv += ["--listen", self.substitute("tcp://127.0.0.1:5151")]
            self.serve(argv, self.env(assignments))
            return
        if args[:1] == ["bench"]:
            argv += [*BENCH_OPTIONS[args[1]], "--json"] if "--json" not in args else []
        if args[:1] == ["top"] and "--once" not in args:
            self.interactive(argv, self.env(assignments), line)
            return
        proc = subprocess.run(
            argv, cwd=self.cwd, env=self.env(assignments), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, f"README line {line!r} failed:\n{proc.stderr}"
        if stdout_file is not None:
            stdout_file.write_text(proc.stdout)
        if "--json" in argv:  # exactly one JSON object on stdout, nothing else
            json.loads(proc.stdout)

    def serve(self, argv: list[str], env: dict[str, str]) -> None:
        """Start a proxy (stopping the block's previous one) and wait until it listens."""
        self.stop()
        self.server = subprocess.Popen(
            argv, cwd=self.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.server.stderr is not None
        deadline = time.monotonic() + 60
        seen = []
        while time.monotonic() < deadline:
            line = self.server.stderr.readline()
            if not line and self.server.poll() is not None:
                break
            seen.append(line)
            if line.startswith("listening on"):
                return
        self.server.kill()
        pytest.fail(f"{shlex.join(argv[2:])} did not start:\n{''.join(seen)}")

    def interactive(self, argv: list[str], env: dict[str, str], line: str) -> None:
        """A live view: it must run (not exit with an error) until it is stopped."""
        proc = subprocess.Popen(
            argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            proc.wait(3)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(10)
            return
        assert proc.stderr is not None
        pytest.fail(f"README line {line!r} exited {proc.returncode}:\n{proc.stderr.read()}")

    def stop(self) -> None:
        """Stop the block's proxy with SIGTERM: it must exit 0."""
        server, self.server = self.server, None
        if server is None:
            return
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(20)
        finally:
            server.kill()
            server.communicate()
        assert code == 0, f"the proxy exited {code} on SIGTERM"


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[Shell]:
    sh = Shell(tmp_path, {"5151": str(_free_port()), "9464": str(_free_port())})
    yield sh
    sh.stop()


BLOCKS = _blocks()


def test_every_skip_names_a_block() -> None:
    for start in SKIPPED:  # (the README and a page may show the same block)
        assert sum(b.text.startswith(start) for b in BLOCKS) >= 1, start


def _runnable(lang: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang and b.skipped is None]


@pytest.mark.slow
@pytest.mark.parametrize("block", _runnable("bash"), ids=lambda b: b.where)
def test_bash_block(block: Block, shell: Shell) -> None:
    for line in block.text.splitlines():
        shell.run_line(line)
    shell.stop()


@pytest.mark.slow
@pytest.mark.parametrize("block", _runnable("python"), ids=lambda b: b.where)
def test_python_block(block: Block, shell: Shell) -> None:
    shell.run_line("gpuremote serve --listen tcp://127.0.0.1:5151 --backend numpy")
    code = shell.substitute(block.text)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=shell.cwd, env=shell.env({}), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"block at {block.where} failed:\n{proc.stderr}"


@pytest.mark.parametrize("block", _runnable("toml"), ids=lambda b: b.where)
def test_toml_block(block: Block) -> None:
    table = tomllib.loads(block.text)
    PipelineConfig(**table["pipeline"])  # every key a real setting
    assert table["url"].startswith("tcp://")


def test_no_block_is_left_unclassified() -> None:
    known = {"bash", "python", "toml"}
    odd = [b for b in BLOCKS if b.lang not in known and b.skipped is None]
    assert not odd, f"blocks with no rule to run them: {[b.where for b in odd]}"
