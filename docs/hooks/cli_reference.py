"""mkdocs hook: the command-line reference, made from gpuremote's own argparse parsers when
the site is built (``docs/reference/cli.md`` holds the marker it replaces), so that every
subcommand and option is documented once, where it is defined."""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- the gpuremote commands, from their parsers -->"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, helps.get(name, ""), sub))
    return out


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest}`"
        if a.option_strings and a.nargs != 0:
            name += f" `{a.metavar or a.dest.upper()}`"
        extra = []
        if a.choices:
            extra.append("one of " + ", ".join(f"`{c}`" for c in a.choices))
        if a.default not in (None, False, argparse.SUPPRESS) and a.nargs != 0:
            extra.append(f"default `{a.default}`")
        text = (a.help or "").replace("%(default)s", str(a.default))
        rows.append(f"| {name} | {_cell(text)}{' (' + '; '.join(extra) + ')' if extra else ''} |")
    if not rows:
        return ["No options."]
    return ["| option | what it does |", "|---|---|", *rows]


def _section(prefix: str, parser: argparse.ArgumentParser, text: str, depth: int) -> list[str]:
    lines = [f"{'#' * depth} `{prefix}`", ""]
    if text:
        lines += [text[0].upper() + text[1:] + ".", ""]
    lines += ["```text", parser.format_usage().strip(), "```", "", *_options(parser), ""]
    for name, help_, sub in _subcommands(parser):
        lines += _section(f"{prefix} {name}", sub, help_, min(depth + 1, 4))
    return lines


def reference() -> str:
    """The reference of ``gpuremote`` and every subcommand, as Markdown."""
    from gpuremote.cli import build_parser

    root = build_parser()
    lines: list[str] = []
    for name, help_, sub in _subcommands(root):
        lines += _section(f"gpuremote {name}", sub, help_, 2)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, reference())
    return markdown
