"""What a weights dtype costs in accuracy: the pool's greedy tokens on SmolLM2 against
`transformers` in float32 on the same GGUF, over the SmolLM2 parity prompts
(tests/test_smollm2.py), for each dtype asked for.

    python -m bench.probes.dtype_agreement [--dtypes float32 bfloat16] [--max-tokens 64]

Two figures per dtype: the greedy prefix (tokens generated before the first that differs
from the reference's) and the teacher-forced agreement (fed the reference's tokens, the
share of positions where the pool's top token is the reference's next one).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from npu_worker.runner import LaunchRunner
from npu_worker.weights.imported import ensure_smollm2, smollm2_gguf
from npu_worker.weights.loader import load_model
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a short poem about Redis streams.",
]
PROMPTS = ["def fibonacci(n):", "Once upon a time, in a small village,"]
CHUNK, MAX_LEN = 64, 256


def prompt_ids(tokenizer: Any) -> list[list[int]]:
    """The parity set's prompts as token ids: chat questions through the chat template."""
    chats = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for q in QUESTIONS
    ]
    return chats + [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]


def prefill(runner: LaunchRunner, token_ids: list[int], start: int) -> torch.Tensor:
    """[1, vocab] logits after one chunk of slot 0's prompt."""
    chunk = PrefillChunk(slot=0, start=start, num_tokens=len(token_ids))
    return runner.prefill([chunk], [token_ids]).logits[:, 0]


def pool_logits(runner: LaunchRunner, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[len(continuation), vocab]: the logits after the prompt and after each fed token."""
    logits = []
    for start in range(0, len(prompt), CHUNK):
        out = prefill(runner, prompt[start : start + CHUNK], start)
    logits.append(out[0].float())
    for i, token in enumerate(continuation[:-1]):
        logits.append(runner.decode([0], [token], [len(prompt) + i])[0].float())
    return torch.stack(logits)


def pool_greedy(runner: LaunchRunner, prompt: list[int], max_tokens: int) -> list[int]:
    """The pool's own greedy continuation, one decode launch a token."""
    for start in range(0, len(prompt), CHUNK):
        logits = prefill(runner, prompt[start : start + CHUNK], start)[0]
    tokens = [int(logits.argmax())]
    while len(tokens) < max_tokens:
        position = len(prompt) + len(tokens) - 1
        tokens.append(int(runner.decode([0], [tokens[-1]], [position])[0].argmax()))
    return tokens


def main(argv: list[str] | None = None) -> int:
    """Print (and with --json write) each dtype's agreement with float32 `transformers`."""
    import transformers

    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.dtype_agreement", description=__doc__
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_grad_enabled(False)
    gguf = smollm2_gguf()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompts = prompt_ids(tokenizer)
    wanted = [
        reference.generate(
            torch.tensor([p]),
            max_new_tokens=args.max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    shapes = LaunchShapes(
        decode_batch=1,
        prefill_chunk=CHUNK,
        prefill_segments=1,
        num_slots=1,
        max_kv_len=MAX_LEN,
        mtp=False,
    )
    results = []
    for dtype in args.dtypes:
        loaded = load_model(ensure_smollm2(), dtype, torch.device("cpu"), MAX_LEN)
        runner = LaunchRunner(loaded.model, shapes)
        prefixes, agreed, total = [], 0, 0
        for prompt, want in zip(prompts, wanted):
            got = pool_greedy(runner, prompt, args.max_tokens)
            differ = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
            prefixes.append(differ[0] if differ else len(want))
            top = pool_logits(runner, prompt, want).argmax(-1).tolist()
            agreed += sum(a == b for a, b in zip(top, want))
            total += len(want)
        results.append(
            {
                "dtype": dtype,
                "greedy_prefix": prefixes,
                "identical_completions": sum(p == args.max_tokens for p in prefixes),
                "teacher_forced_agreement": agreed / total,
                "positions": total,
            }
        )
        row = results[-1]
        print(
            f"{dtype}: {row['identical_completions']}/{len(prompts)} completions identical to "
            f"transformers float32 over {args.max_tokens} tokens; greedy prefix per prompt "
            f"{prefixes}; teacher-forced top-1 agreement {row['teacher_forced_agreement']:.3f} "
            f"of {total} positions"
        )
    # the same figures for transformers itself in bfloat16: what the dtype costs anywhere
    ours = reference.to(torch.bfloat16)
    prefixes, agreed, total = [], 0, 0
    for prompt, want in zip(prompts, wanted):
        got = ours.generate(
            torch.tensor([prompt]),
            max_new_tokens=args.max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        differ = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        prefixes.append(differ[0] if differ else len(want))
        fed = torch.tensor([prompt + want[:-1]])
        top = ours(fed).logits[0, len(prompt) - 1 :].argmax(-1).tolist()
        agreed += sum(a == b for a, b in zip(top, want))
        total += len(want)
    results.append(
        {
            "dtype": "bfloat16 (transformers)",
            "greedy_prefix": prefixes,
            "identical_completions": sum(p == args.max_tokens for p in prefixes),
            "teacher_forced_agreement": agreed / total,
            "positions": total,
        }
    )
    print(
        f"transformers in bfloat16: {results[-1]['identical_completions']}/{len(prompts)} "
        f"identical; greedy prefix per prompt {prefixes}; teacher-forced top-1 agreement "
        f"{agreed / total:.3f} of {total} positions"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
