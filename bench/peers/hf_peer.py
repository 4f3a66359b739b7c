"""What people run instead of npu-pool, for `npu-pool bench` to compare against, on the same
checkpoint through Hugging Face `transformers` (installed with the `bench` extra):

- the queue-worker peer: one RQ job per request, an RQ worker calling `generate` per job;
- the offline peer: `transformers` static-batch `generate` at a fixed batch size.

    python -m bench.peers.hf_peer offline --model DIR --batch 8 --prompt-len 64 --max-tokens 64
    python -m bench.peers.hf_peer rq-worker --redis-url URL --model DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import lru_cache
from typing import Any

import torch

from npu_worker.weights.presets import resolve_model_dir

RQ_QUEUE = "npupool-peer"


@lru_cache(maxsize=2)
def hf_model(model: str) -> Any:
    """The checkpoint (a directory or a preset name) as a transformers model, loaded once."""
    import transformers

    path = resolve_model_dir(model)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def rq_generate(model_dir: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The RQ job: greedy `generate` for one request; returns its completion token ids."""
    model = hf_model(model_dir)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def offline(
    model_dir: str, batch: int, prompt_len: int, max_tokens: int, rounds: int
) -> dict[str, float]:
    """Tokens/s of static-batch greedy `generate` (equal-length prompts: no padding)."""
    model = hf_model(model_dir)
    prompts = torch.randint(
        2, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        model.generate(prompts, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        started = time.perf_counter()
        for _ in range(rounds):
            model.generate(
                prompts,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - started
    return {
        "output_tokens_per_s": rounds * batch * max_tokens / elapsed,
        "batch": batch,
        "threads": torch.get_num_threads(),
    }


def rq_worker(redis_url: str, model_dir: str) -> None:
    """An RQ worker (no fork per job, the model stays loaded) on the peer queue."""
    import redis
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    hf_model(model_dir)
    connection = redis.Redis.from_url(redis_url)
    queue = Queue(RQ_QUEUE, connection=connection, serializer=JSONSerializer)
    SimpleWorker([queue], connection=connection, serializer=JSONSerializer).work(burst=False)


def main(argv: list[str] | None = None) -> int:
    """`offline` prints JSON; `rq-worker` serves the peer queue until killed."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["offline", "rq-worker"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "offline":
        print(
            json.dumps(
                offline(args.model, args.batch, args.prompt_len, args.max_tokens, args.rounds)
            )
        )
    else:
        rq_worker(args.redis_url, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
