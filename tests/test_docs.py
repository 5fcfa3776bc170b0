"""The documentation site: it builds strictly (a broken link or reference fails), a headless
browser shows its pages with their titles and no broken link, every public name has a
docstring and a place in the API reference, and the command-line reference has every
subcommand and option of the parsers. (Its code blocks run in ``test_readme.py``.)"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest

import gpuremote
import gpuremote.pool
import gpuremote.xp
from gpuremote.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as CI builds it: ``mkdocs build --strict``."""
    pytest.importorskip("mkdocs", reason="the docs site needs the [docs] extra")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    return out


def _public_modules() -> Iterator[Any]:
    yield gpuremote
    yield gpuremote.xp
    yield gpuremote.pool
    try:
        yield importlib.import_module("gpuremote.torch")
    except ImportError:  # without the [torch] extra
        return


def test_every_public_name_has_a_docstring() -> None:
    missing = []
    for mod in _public_modules():
        for name in mod.__all__:
            obj = getattr(mod, name)
            documented = inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)
            if documented and not (inspect.getdoc(obj) or "").strip():
                missing.append(f"{mod.__name__}.{name}")
    assert not missing, f"public names without a docstring: {missing}"


@pytest.mark.slow
def test_every_public_name_is_in_the_api_reference(site: Path) -> None:
    html = (site / "reference" / "api" / "index.html").read_text()
    ids = set(re.findall(r'id="([^"]+)"', html))
    missing = []
    for mod in _public_modules():
        for name in mod.__all__:
            found = any(i == f"{mod.__name__}.{name}" or i.endswith(f".{name}") for i in ids)
            data = not callable(getattr(mod, name)) and not inspect.ismodule(getattr(mod, name))
            if not found and not (data and re.search(rf"\b{re.escape(name)}\b", html)):
                missing.append(f"{mod.__name__}.{name}")
    assert not missing, f"public names missing from the API reference: {missing}"


def _commands(
    parser: argparse.ArgumentParser, prefix: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _commands(sub, f"{prefix} {name}")


def test_the_cli_reference_has_every_subcommand_and_option(site: Path) -> None:
    html = (site / "reference" / "cli" / "index.html").read_text()
    for command, parser in _commands(build_parser(), "gpuremote"):
        anchor = command.replace(" ", "-")
        assert f'id="{anchor}"' in html, command
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"<code>{option}</code>" in html, f"{command} {option}"


class _Page(HTMLParser):
    """A page's title and the links it has (from the DOM the browser rendered)."""

    def __init__(self) -> None:
        super().__init__()
        self.title = ""
        self.links: list[str] = []
        self.images: list[str] = []
        self.ids: set[str] = set()
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "title":
            self._in_title = True
        elif tag == "a" and a.get("href"):
            self.links.append(str(a["href"]))
        elif tag == "img" and a.get("src"):
            self.images.append(str(a["src"]))

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless browser (Debian's chromium: apt-get install chromium)")


def _rendered(browser: str, page: Path) -> _Page:
    """``page`` as a headless browser renders it (its DOM after the scripts ran)."""
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--virtual-time-budget=3000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "<html" in proc.stdout, proc.stderr[-2000:]
    parsed = _Page()
    parsed.feed(proc.stdout)
    return parsed


@pytest.mark.slow
@pytest.mark.parametrize(
    "page, title",
    [
        ("index.html", "gpuremote"),
        ("guides/pytorch/index.html", "PyTorch"),
        ("reference/api/index.html", "Python API"),
    ],
)
def test_pages_in_a_headless_browser(site: Path, page: str, title: str) -> None:
    rendered = _rendered(_browser(), site / page)
    assert rendered.title.strip().startswith(title), rendered.title
    where = (site / page).parent
    broken = []
    for link in [*rendered.links, *rendered.images]:
        url = urlparse(link)
        if url.scheme in ("http", "https", "mailto", "data", "javascript"):
            continue
        if url.scheme == "file":
            target = Path(unquote(url.path))
        elif not url.path:  # an anchor on this page
            if url.fragment and url.fragment not in rendered.ids:
                broken.append(link)
            continue
        else:
            target = (where / unquote(url.path)).resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            broken.append(link)
    assert not broken, f"broken links on {page}: {broken}"
