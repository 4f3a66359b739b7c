"""Where a DeepSeek-V4 launch spends its time, by part, on one CPU thread:

    python -m bench.probes.v4_breakdown DIR [--decode-batch 8] [--prefill-chunk 128] [--launches 40]

Times B`decode_batch`S1 decode launches (every row `--context` tokens in) and B1S`chunk`
prefill launches of the checkpoint in DIR through the runner, with wall-clock timers
hooked onto the model's modules from here (forward pre/post hooks, and wrappers around the
hyper-connection functions), so the model code runs as it is. Each part's time is its own,
less the parts timed inside it: attention by layer kind (a CSA layer's compressor and
indexer, and an HCA layer's compressor, apart), the MoE by router kind (routed experts and
router; the shared expert apart), the hyper-connections (`hyper_mix`, whose Sinkhorn
iterations dominate, `hyper_add`, and `hc_head`), and the rest of the launch (embedding,
norms, head, the runner's own work). The timers add a few microseconds per part per
layer; the table gives their total next to the launch time.
"""

from __future__ import annotations

import argparse
import datetime
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from npu_worker.expert_parallel import ProcessGroupExperts, process_group
from npu_worker.models.deepseek_v4 import blocks
from npu_worker.models.deepseek_v4.attention import Attention, Compressor, Indexer
from npu_worker.models.deepseek_v4.config import CSA, HCA, SLIDING
from npu_worker.models.deepseek_v4.model import DeepseekV4CausalLM
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes

KIND_NAMES = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}


class Timers:
    """Wall time per label, each less the labelled parts inside it."""

    def __init__(self) -> None:
        self.own: defaultdict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = []  # [label, start, time of the parts inside]
        self.enabled = False

    def enter(self, label: str) -> None:
        if self.enabled:
            self.stack.append([label, time.perf_counter(), 0.0])

    def leave(self) -> None:
        if not self.enabled:
            return
        label, start, inner = self.stack.pop()
        spent = time.perf_counter() - start
        self.own[label] += spent - inner
        if self.stack:
            self.stack[-1][2] += spent

    def hook(self, module: nn.Module, label: str) -> None:
        module.register_forward_pre_hook(lambda *_: self.enter(label))
        module.register_forward_hook(lambda *_: self.leave())

    def wrap(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(label)
            try:
                return function(*args, **kwargs)
            finally:
                self.leave()

        return timed


def label_parts(model: DeepseekV4CausalLM, timers: Timers) -> None:
    """Hook the timers onto the main model's parts (the MTP block is not run here)."""
    for block in model.model.layers:
        attn = block.attn
        assert isinstance(attn, Attention)
        kind = KIND_NAMES[attn.kind]
        timers.hook(attn, f"attention {kind}")
        if attn.rate:
            assert isinstance(attn.compressor, Compressor)
            timers.hook(attn.compressor, f"attention {kind}: compressor")
        if attn.kind == CSA:
            assert isinstance(attn.indexer, Indexer)
            timers.hook(attn.indexer, f"attention {kind}: indexer")
            timers.hook(attn.indexer.compressor, f"attention {kind}: indexer")
        moe = block.ffn
        assert isinstance(moe, blocks.MoE)
        kind = "hash-routed" if moe.gate.hashed else "scored"
        timers.hook(moe, f"MoE {kind}: router + routed experts")
        timers.hook(moe.shared_experts, "MoE: shared expert")
    timers.hook(model.model.hc_head, "hyper-connections: hc_head")
    blocks.hyper_mix = timers.wrap(blocks.hyper_mix, "hyper-connections: mix (Sinkhorn)")
    blocks.hyper_add = timers.wrap(blocks.hyper_add, "hyper-connections: add")


def measure(
    call: Callable[[], Any], timers: Timers, launches: int
) -> tuple[float, dict[str, float]]:
    """Mean wall time of a launch and each part's mean own time, in ms."""
    for _ in range(3):
        call()
    timers.own.clear()
    timers.enabled = True
    start = time.perf_counter()
    for _ in range(launches):
        call()
    total = (time.perf_counter() - start) / launches
    timers.enabled = False
    return total * 1e3, {k: v / launches * 1e3 for k, v in timers.own.items()}


def overhead(timers: Timers, parts: int) -> float:
    """ms the timers add to a launch with `parts` timed parts, measured on empty ones."""
    rounds = 2000
    timers.enabled = True
    start = time.perf_counter()
    for _ in range(rounds):
        timers.enter("timer overhead")
        timers.leave()
    spent = (time.perf_counter() - start) / rounds
    timers.enabled = False
    timers.own.pop("timer overhead", None)
    return spent * parts * 1e3


ORDER = (
    "attention sliding",
    "attention CSA",
    "attention CSA: compressor",
    "attention CSA: indexer",
    "attention HCA",
    "attention HCA: compressor",
    "MoE hash-routed: router + routed experts",
    "MoE scored: router + routed experts",
    "MoE: shared expert",
    "MoE: collectives (allgather + alltoall)",
    "hyper-connections: mix (Sinkhorn)",
    "hyper-connections: add",
    "hyper-connections: hc_head",
)
GROUPS = ("attention", "MoE", "hyper-connections")
Results = dict[str, tuple[float, dict[str, float]]]


def run(args: argparse.Namespace, rank: int, size: int, store_path: str) -> Results:
    """Load, hook and time both launches on this rank (of `size`, experts split over them
    when `size` > 1); the median of `--repeats` timings of each."""
    torch.set_num_threads(args.threads)
    expert_rank = (rank, size) if size > 1 else None
    loaded = load_model(
        args.model, "float32", torch.device("cpu"), args.max_model_len, expert_rank=expert_rank
    )
    model = loaded.model
    assert isinstance(model, DeepseekV4CausalLM)
    timers = Timers()
    if size > 1:
        store = dist.FileStore(store_path, size)
        group = ProcessGroupExperts(
            process_group("gloo", store, rank, size, datetime.timedelta(seconds=120)), rank, size
        )
        group.gather = timers.wrap(group.gather, ORDER[9])  # type: ignore[method-assign]
        group.combine = timers.wrap(group.combine, ORDER[9])  # type: ignore[method-assign]
        model.use_experts(group)
    batch, chunk = args.decode_batch, args.prefill_chunk
    shapes = LaunchShapes(batch, chunk, 1, batch + 1, args.max_model_len, False, size > 1)
    runner = LaunchRunner(model, shapes)
    label_parts(model, timers)

    rng = random.Random(rank)
    vocab = model.config.vocab_size
    context = args.context
    for slot in range(batch):  # every decode row `context` tokens in
        prompt = [rng.randrange(2, vocab) for _ in range(context)]
        for start in range(0, context, chunk):
            part = prompt[start : start + chunk]
            runner.prefill([PrefillChunk(slot, start, len(part))], [part])
    rows = list(range(batch))
    tokens = [rng.randrange(2, vocab) for _ in rows]
    chunk_ids = [rng.randrange(2, vocab) for _ in range(chunk)]
    calls: dict[str, tuple[Callable[[], Any], int]] = {
        f"B{batch}S1 decode ({context} in)": (
            lambda: runner.decode(rows, tokens, [context] * batch),
            args.launches,
        ),
        f"B1S{chunk} prefill": (
            lambda: runner.prefill([PrefillChunk(batch, 0, chunk)], [chunk_ids]),
            args.launches // 4,
        ),
    }
    results: Results = {}
    for name, (call, launches) in calls.items():
        runs = sorted(
            (measure(call, timers, max(4, launches)) for _ in range(args.repeats)),
            key=lambda r: r[0],
        )
        results[name] = runs[len(runs) // 2]
    return results


def ranked(rank: int, args: argparse.Namespace, size: int, store_path: str, out: Any) -> None:
    results = run(args, rank, size, store_path)
    if rank == 0:
        out.put(results)


def table(results: Results) -> list[str]:
    """The markdown table: each part's own time and share of the launch, then the groups."""
    names = list(results)

    def row(label: str, values: list[float]) -> str:
        cells = [f"{ms:.2f} ms ({ms / results[n][0]:.0%})" for n, ms in zip(names, values)]
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = ["| part | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label in ORDER:
        if any(label in own for _, own in results.values()):
            lines.append(row(label, [own.get(label, 0.0) for _, own in results.values()]))
    rest = [total - sum(own.values()) for total, own in results.values()]
    lines.append(row("rest (embedding, norms, head, runner)", rest))
    for group in GROUPS:
        sums = [
            sum(v for k, v in own.items() if k.startswith(group)) for _, own in results.values()
        ]
        lines.append(row(f"*all {group}*", sums))
    lines.append(
        "| **launch** | " + " | ".join(f"**{results[n][0]:.2f} ms**" for n in names) + " |"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--context", type=int, default=160, help="decode rows' tokens so far")
    parser.add_argument("--launches", type=int, default=40, help="decode launches a timing")
    parser.add_argument("--repeats", type=int, default=3, help="timings; the median is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--ranks", type=int, default=1, help="with 2 or more: experts split over the ranks"
    )
    args = parser.parse_args()
    if args.ranks == 1:
        results = run(args, 0, 1, "")
    else:
        context = mp.get_context("spawn")
        out = context.Queue()
        with tempfile.TemporaryDirectory() as scratch:
            store_path = str(Path(scratch) / "store")
            procs = [
                context.Process(target=ranked, args=(r, args, args.ranks, store_path, out))
                for r in range(args.ranks)
            ]
            for proc in procs:
                proc.start()
            results = out.get()
            for proc in procs:
                proc.join()
    cost = overhead(Timers(), 2 * 4 * 3 + 8)
    print(
        f"ranks: {args.ranks}; torch threads per rank: {args.threads}; rank 0's launches; "
        f"the timers add about {cost:.3f} ms a launch"
    )
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
