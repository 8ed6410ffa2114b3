"""Every command the README and docs/ show still works as written: each `cachefs ...` line
parses with today's CLI (its options exist and its values are valid), each
`python tools/NAME.py ...` names a tool, a subcommand and options that tool has, and each
`make TARGET` is a target of the Makefile. Paths and placeholders (SOURCE, MOUNTPOINT,
DIR, ...) are kept as written: what runs for real is covered by the mounted tests."""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cachefs.cli import _negative_values_joined, build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDERS = {"RANK/WORLD": "0/2", "[SECONDS]": "", "[HOST:]PORT": "9100"}


def _commands() -> list[tuple[str, str, bool]]:
    """(where, command, whole) for every command in the docs' code blocks (whole command
    lines) and inline code (often a command and an option named in a sentence)."""
    found: list[tuple[str, str, bool]] = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            where = f"{doc.relative_to(ROOT)}:{i + 1}"
            if line.startswith("    "):
                text = line.strip().removeprefix("$ ")
                while text.endswith("\\") and i + 1 < len(lines):  # continued on the next line
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                found.append((where, text, True))
            else:
                found += [(where, span, False) for span in re.findall(r"`([^`]+)`", line)]
            i += 1
    out = []
    for where, text, whole in found:
        text = re.split(r"\s+#|\s{2,}\(", text)[0].strip()   # a comment, or "(slowfs at 5 ms...)"
        if re.match(r"(cachefs |python tools/\S|make \S)", text):
            out.append((where, text, whole))
    return out


COMMANDS = _commands()


def _argv(text: str) -> list[str]:
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    return shlex.split(text)


@pytest.mark.parametrize("where,text,whole", [c for c in COMMANDS if c[1].startswith("cachefs ")],
                         ids=lambda x: x if isinstance(x, str) and ":" in x else None)
def test_every_cachefs_command_in_the_docs_parses(where, text, whole):
    argv = _argv(text)[1:]
    parser = build_parser()
    if not whole:  # a command named in a sentence: its options must exist
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        assert argv and argv[0] in commands, f"{where}: `{text}`: no command {argv[:1]}"
        options = {o for a in commands[argv[0]]._actions for o in a.option_strings}
        for token in argv[1:]:
            if token.startswith("-"):
                assert token.split("=", 1)[0] in options, f"{where}: `{text}`: cachefs {argv[0]} has no {token}"
        return
    try:
        _, extra = parser.parse_known_args(_negative_values_joined(argv))
    except SystemExit as exc:
        pytest.fail(f"{where}: `{text}` no longer parses (exit {exc.code})")
    assert not extra, f"{where}: `{text}`: unknown {extra}"


@functools.cache
def _help(script: str, sub: str | None) -> str:
    argv = [sys.executable, str(ROOT / "tools" / script), *([sub] if sub else []), "--help"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60)
    return proc.stdout + proc.stderr if proc.returncode == 0 else f"FAILED {proc.returncode}: {proc.stderr}"


@pytest.mark.parametrize("where,text,whole", [c for c in COMMANDS if c[1].startswith("python tools/")],
                         ids=lambda x: x if isinstance(x, str) and ":" in x else None)
def test_every_tool_command_in_the_docs_names_what_the_tool_has(where, text, whole):
    argv = _argv(text)
    script = argv[1].removeprefix("tools/")
    assert (ROOT / "tools" / script).is_file(), f"{where}: no tools/{script}"
    sub = argv[2] if len(argv) > 2 and not argv[2].startswith("-") else None
    helptext = _help(script, sub)
    assert not helptext.startswith("FAILED"), f"{where}: `{' '.join(argv[1:3])} --help` {helptext}"
    for token in argv[2:]:
        if token.startswith("--"):
            option = token.split("=", 1)[0]
            assert re.search(rf"{re.escape(option)}\b", helptext), f"{where}: `{text}`: tools/{script} has no {option}"


def test_every_make_target_in_the_docs_exists():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    for where, text, _ in COMMANDS:
        if text.startswith("make "):
            for word in _argv(text)[1:]:
                if "=" not in word and not word.startswith("-"):
                    assert word in targets, f"{where}: `{text}`: no make target {word}"


def test_the_docs_show_commands_at_all():
    """A guard for the extraction itself."""
    kinds = {text.split()[0] + (" " + text.split()[1] if text.startswith("cachefs ") else "")
             for _, text, _ in COMMANDS}
    assert {"cachefs mount", "cachefs stats", "cachefs warm", "cachefs umount", "make"} <= kinds
    assert sum(text.startswith("python tools/") for _, text, _ in COMMANDS) >= 10
    assert os.path.exists(ROOT / "Makefile")
