"""Check that vLLM, `transformers` and the pool read a checkpoint the same way.

vLLM (run by the given Python, as `npu-pool bench --vllm-python` runs it) generates a few
seeded requests greedily; its tokens must be `transformers`' greedy tokens (up to a near-tie)
its tokenizer must encode and decode a text as the pool's does; the pool's loader must load
the checkpoint.

    python -m bench.peers.vllm_check --model DIR --vllm-python PATH
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer

from bench.loadgen import Workload
from bench.peers.vllm_bench import run_offline
from bench.peers.vllm_env import check_vllm_peer
from npu_worker.weights.loader import load_model
from schemas.config import Settings

TIE_TOLERANCE = 1e-3  # a top-2 logit gap under this may resolve either way in float32
NUM_REQUESTS = 8
MAX_TOKENS = 32


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """`transformers`' greedy tokens, and the top-2 logit gap at each of them."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tops = [s[0].topk(2).values for s in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), [float(t[0] - t[1]) for t in tops]


def difference(got: list[int], want: list[int], gaps: list[float]) -> str | None:
    """None if `got` is `want` up to a near-tie (after which they may part), else where not."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return (
                None if gaps[i] <= TIE_TOLERANCE else f"token {i}: {a} != {b} (gap {gaps[i]:.3g})"
            )
    return None if len(got) == len(want) else f"length {len(got)} != {len(want)}"


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when all three agree; print what differs otherwise."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--vllm-python", required=True)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    # float32 on both sides: the comparison is with transformers' float32 greedy tokens, up to
    # a float32 near-tie (`auto` would be bfloat16 on a CPU that has it natively)
    settings = Settings(model=str(args.model), dtype="float32")
    load_model(args.model, settings.dtype, torch.device("cpu"), settings.max_kv_len)
    print(f"the pool's loader loads {args.model}")
    peer = check_vllm_peer(args.vllm_python, settings, threads=1)
    workload = Workload(NUM_REQUESTS, (16, 96), (MAX_TOKENS, MAX_TOKENS), seed=7)
    engine = {"max_model_len": settings.max_model_len, "max_num_seqs": 8, "seed": 0}
    result = run_offline(peer, workload, engine, Path(tempfile.mkdtemp()), token_ids=True)
    print(f"vLLM {peer.vllm_version} (torch {peer.torch_version}) ran {args.model}")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    problems = []
    for i, (prompt, _) in enumerate(workload.requests()):
        want, gaps = hf_greedy(model, prompt, MAX_TOKENS)
        if (problem := difference(result["completions"][i], want, gaps)) is not None:
            problems.append(f"request {i}: vLLM against transformers: {problem}")
    check = result["tokenizer_check"]
    if check["ids"] != tokenizer.encode(check["text"]).ids or check["decoded"] != check["text"]:
        problems.append(f"vLLM's tokenizer differs from the pool's: {check}")
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(
            f"vLLM's greedy tokens match transformers' on {NUM_REQUESTS} requests;"
            " its tokenizer encodes and decodes as the pool's"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
