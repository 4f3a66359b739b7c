"""vLLM's offline engine on a bench workload, for `npu-pool bench --vllm-python`.

Run by the Python of a vLLM environment, as a file (it imports nothing of this project, and
the project never imports vLLM):

    VLLM_PYTHON -P bench/peers/vllm_offline.py --model DIR --workload FILE --out FILE [flags]

(`-P`: this file's directory holds modules, such as `requests.py`, that would shadow
vLLM's own imports.)

FILE holds `{"requests": [[prompt_token_ids, max_tokens], ...]}`. After a warm-up, the
engine generates the whole workload (greedy, EOS ignored), then the same prompts with one
output token each (the prefill alone); prefix caching is off so that the second pass
recomputes every prompt. Writes versions, settings and timings as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

WARMUP_REQUESTS = 8
TOKENIZER_CHECK_TEXT = "Hello, world! Größe, naïve café, 東京, emoji 🙂"


def _generate(llm: Any, requests: list[tuple[list[int], int]]) -> tuple[float, list[Any]]:
    """Wall seconds and the completions of one `generate` over `requests`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _, max_tokens in requests
    ]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    return wall, [out.outputs[0] for out in outputs]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, warm it up, time the workload and its prefill alone."""
    import torch
    import vllm

    raw = json.loads(Path(args.workload).read_text())["requests"]
    requests = [(list(map(int, ids)), int(max_tokens)) for ids, max_tokens in raw]
    if not requests:
        raise ValueError(f"{args.workload} holds no requests")
    started = time.perf_counter()
    llm = vllm.LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        enable_prefix_caching=False,
    )
    startup_s = time.perf_counter() - started
    _generate(llm, [(ids, 8) for ids, _ in requests[:WARMUP_REQUESTS]])
    wall, completions = _generate(llm, requests)
    prefill_wall, _ = _generate(llm, [(ids, 1) for ids, _ in requests])
    output_tokens = sum(len(out.token_ids) for out in completions)
    decode_tokens = output_tokens - len(requests)  # the first token of each comes with prefill
    decode_wall = wall - prefill_wall
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    out: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "startup_s": round(startup_s, 1),
        "requests": len(requests),
        "prompt_tokens": sum(len(ids) for ids, _ in requests),
        "output_tokens": output_tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": output_tokens / wall,
        "prefill_wall_s": round(prefill_wall, 3),
        "decode_tokens_per_s": decode_tokens / decode_wall if decode_wall > 0 else None,
        "engine": {
            "dtype": args.dtype,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "prefix_caching": False,
            "seed": args.seed,
        },
    }
    if args.token_ids:
        out["completions"] = [list(c.token_ids) for c in completions]
        tokenizer = llm.get_tokenizer()
        ids = tokenizer.encode(TOKENIZER_CHECK_TEXT, add_special_tokens=False)
        out["tokenizer_check"] = {
            "text": TOKENIZER_CHECK_TEXT,
            "ids": ids,
            "decoded": tokenizer.decode(ids),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the engine and write its JSON result to --out."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--workload", required=True, help="JSON file of the requests")
    parser.add_argument("--out", required=True, help="JSON file to write the result to")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="also write every completion and a tokenizer round trip",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    Path(args.out).write_text(json.dumps(run(args)))
    return 0


if __name__ == "__main__":  # vLLM's CPU engine spawns its processes: keep them off this path
    sys.exit(main())
