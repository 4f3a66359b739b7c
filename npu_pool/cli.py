"""`npu-pool`: a thin dispatcher; each subcommand lives in the package that owns it."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

from npu_pool.extras import COMMAND_EXTRAS, MissingExtra, extra_for, require

# subcommand -> (module, function, one-line help); modules load only when called,
# so `npu-pool submit` never imports torch.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": (
        "npu_pool.launcher",
        "up_main",
        "start a pool (embedded Redis when no URL) and supervise it",
    ),
    "demo": ("npu_pool.demo", "main", "start a pool, stream concurrent requests live, summarise"),
    "batcher": ("batcher.service", "main", "run one pool's batcher"),
    "worker": ("npu_worker.service", "main", "run one worker rank"),
    "submit": ("producer.cli", "submit_main", "submit a request and print or stream its result"),
    "cancel": ("producer.cli", "cancel_main", "cancel requests by id"),
    "status": ("producer.cli", "status_main", "show pools, ranks and the queue"),
    "batch": ("producer.batch.cli", "main", "offline batch jobs through RQ"),
    "bench": ("bench.serve", "main", "benchmarks: --kernels for the launch microbenchmark"),
    "models": ("npu_worker.weights.cli", "main", "models import FILE.gguf: a model directory"),
    "gateway": (
        "producer.gateway.cli",
        "main",
        "OpenAI-compatible HTTP front with resumable SSE result streams",
    ),
}


def usage() -> str:
    """The top-level help text."""
    lines = ["usage: npu-pool COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_text}" for name, (_, _, help_text) in COMMANDS.items()]
    lines += ["", "`npu-pool COMMAND --help` shows a command's options; `npu-pool --version`."]
    return "\n".join(lines)


def version() -> str:
    """The installed version of the `npu-pool` distribution."""
    try:
        return importlib.metadata.version("npu-pool")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `npu-pool` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"npu-pool {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"npu-pool: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = COMMANDS[name]
    try:
        if name in COMMAND_EXTRAS:
            require(COMMAND_EXTRAS[name])
        function = getattr(importlib.import_module(module_name), function_name)
        return int(function(rest) or 0)
    except ModuleNotFoundError as exc:  # an optional dependency: name the extra that has it
        extra = extra_for(exc.name, name)
        if extra is None:
            raise
        print(f"npu-pool {name}: {MissingExtra(extra, exc.name or '')}", file=sys.stderr)
        return 2
    except MissingExtra as exc:
        print(f"npu-pool {name}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
