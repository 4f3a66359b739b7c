"""`npu-pool models import FILE.gguf [--out DIR]`: a GGUF file into a model directory."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.progress import Progress

from npu_worker.models.config import UnsupportedModel


def main(argv: list[str]) -> int:
    """Dispatch `npu-pool models` subcommands."""
    parser = argparse.ArgumentParser(prog="npu-pool models", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    importing = commands.add_parser(
        "import",
        help="import a GGUF file",
        description="Write a GGUF file (llama.cpp) as a model directory: config.json, "
        "model.safetensors (float32), tokenizer.json, tokenizer_config.json (chat template) "
        "and generation_config.json. Without --out it goes into the cache, where "
        "`--model FILE.gguf` finds it.",
    )
    importing.add_argument("gguf", type=Path, metavar="FILE.gguf", help="the GGUF file to import")
    importing.add_argument("--out", type=Path, default=None, help="directory to write")
    args = parser.parse_args(argv)
    return import_main(args.gguf, args.out)


def import_main(gguf: Path, out: Path | None) -> int:
    """Import `gguf` to `out` (or the cache) with a progress bar; print the directory."""
    from npu_worker.weights.gguf.convert import import_gguf
    from npu_worker.weights.imported import ensure_imported

    started = time.monotonic()
    with Progress(transient=True) as bars:
        task = bars.add_task(f"importing {gguf.name}", total=1)

        def report(what: str, done: int, total: int) -> None:
            bars.update(task, description=what, completed=done, total=max(total, 1))

        try:
            path = (
                ensure_imported(gguf, progress=report)
                if out is None
                else import_gguf(gguf, out, report)
            )
        except (UnsupportedModel, FileExistsError) as exc:
            print(f"npu-pool models import: {exc}", file=sys.stderr)
            return 1
    print(f"{path}  ({time.monotonic() - started:.1f} s; serve it with --model {path})")
    return 0
