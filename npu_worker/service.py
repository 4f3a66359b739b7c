"""`npu-pool worker --rank R`: one worker rank of a pool (the rank itself: npu_worker/rank.py).

Flags are parsed before torch is imported, so `--help` and bad flags answer at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from schemas.config import EXIT_FAILED, add_settings_flags, settings_from_args

log = logging.getLogger("npu_pool.worker")


def build_parser() -> argparse.ArgumentParser:
    """The flags of `npu-pool worker`."""
    parser = argparse.ArgumentParser(prog="npu-pool worker", description=__doc__)
    parser.add_argument("--rank", type=int, required=True, help="this worker's rank")
    add_settings_flags(parser)
    return parser


def main(argv: list[str]) -> int:
    """`npu-pool worker --rank R`: run one rank until SIGTERM/SIGINT."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"npu-pool worker: {exc}", file=sys.stderr)
        return 2
    import torch

    from npu_worker.rank import RankFailed, Worker

    try:
        worker = Worker(settings, args.rank)
    except ValueError as exc:
        print(f"npu-pool worker: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(message)s")
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    torch.set_grad_enabled(False)
    try:
        worker.run()
    except RankFailed as exc:
        log.error("rank %d cannot start: %s", args.rank, exc)
        return EXIT_FAILED
    return 0
