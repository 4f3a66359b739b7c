"""The CLI explains itself: every flag of every command has a help text, `--help` answers
without importing torch, and `npu-pool --version` names the installed version."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest

from npu_pool.cli import COMMANDS

pytestmark = pytest.mark.fast

SUBCOMMANDS = [
    ["batch", "submit"],
    ["batch", "worker"],
    ["batch", "status"],
    ["batch", "result"],
    ["models", "import"],
]
# Every `--help` in one process, which must not have imported torch when done.
HELP_ALL = """
import contextlib, io, json, sys
from npu_pool.cli import main
texts = {}
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--help"])
        except SystemExit:
            pass
    texts[" ".join(argv)] = out.getvalue()
print(json.dumps({"texts": texts, "torch": "torch" in sys.modules}))
"""


def options_without_help(text: str) -> list[str]:
    """Flags and arguments of an argparse help text that have no help of their own."""
    lines = text.splitlines()
    missing = []
    for i, line in enumerate(lines):
        entry = re.match(r"^  ([^\s{].*?)(\s{2,}\S.*)?$", line)
        if entry is None:
            continue
        wrapped = i + 1 < len(lines) and re.match(r"^\s{8,}\S", lines[i + 1])
        if entry.group(2) is None and not wrapped:
            missing.append(entry.group(1))
    return missing


def help_texts() -> tuple[dict[str, str], bool]:
    argvs = [[name] for name in COMMANDS] + SUBCOMMANDS
    done = subprocess.run(
        [sys.executable, "-c", HELP_ALL, json.dumps(argvs)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=dict(os.environ, COLUMNS="100"),
    )
    found = json.loads(done.stdout)
    return found["texts"], found["torch"]


def test_every_flag_of_every_command_has_a_help_text_and_help_never_loads_torch() -> None:
    texts, torch_loaded = help_texts()
    kernels = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "bench", "--kernels", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    texts["bench --kernels"] = kernels
    assert all(text.startswith("usage: npu-pool") for text in texts.values()), texts
    missing = {name: options_without_help(text) for name, text in texts.items()}
    assert {name: flags for name, flags in missing.items() if flags} == {}
    assert not torch_loaded
    assert "--kernels" in texts["bench"] and "\n    npu-pool bench --kernels" in texts["bench"]
    assert "tiny, small, smollm2" in texts["up"] and "npu-pool up" in texts["batch"]


def test_the_help_checker_finds_a_flag_without_help() -> None:
    text = (
        "positional arguments:\n  {a,b}\n    a  help\n  path\n  other  help\n"
        "options:\n  -h, --help  show this help message and exit\n  --bare BARE\n"
        "  --long-one LONG_ONE\n                        wrapped help\n  --inline X  help\n"
    )
    assert options_without_help(text) == ["path", "--bare BARE"]


def test_version_names_the_installed_distribution() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "npu_pool.cli", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0
    assert done.stdout == f"npu-pool {importlib.metadata.version('npu-pool')}\n"
