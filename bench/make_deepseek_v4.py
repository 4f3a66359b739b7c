"""A small random DeepSeek-V4 checkpoint written by `transformers` (a test and bench
dependency), with the tiny model's byte-level tokenizer, for the tests and `npu-pool bench`:

    python -m bench.make_deepseek_v4 DIR [--windows small|real] [--bench]

Every layer type is present (sliding, CSA, HCA) and both MoE kinds (hash-routed first, then
scored). `--windows small` uses a 16-token window and compress rates 4/16, so short prompts
cross many window boundaries; `--windows real` the V4-Flash values 128/4/128. Weights are
scaled up so greedy top-1/top-2 logit margins are clear, and the parameters transformers
initialises to constants (sinks, `ape`, hyper-connection bases, router biases, `tid2eid`)
are random, so each of them matters to the tokens. With `--mtp` the checkpoint also gets
an MTP module (`mtp.0.*`: a sliding-window block with scored experts, `e_proj`, `h_proj`,
`enorm`, `hnorm`, `norm`, `hc_head_*`), which transformers neither builds nor saves, fitted
to draft the model's own greedy continuations. With `--fp8` the attention projections are
stored as float8 e4m3 with 128x128 block scales (`weight_scale_inv`), as DeepSeek releases
V4's attention weights.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from bench.make_deepseek_v3 import fp8_blocks
from npu_worker.models.deepseek_v4 import DeepseekV4CausalLM
from npu_worker.models.launch import LaunchInputs
from npu_worker.models.loader import load_model
from npu_worker.models.tiny import ensure_tiny_model
from npu_worker.runner import LaunchRunner
from schemas.registry import LaunchShapes

VOCAB_SIZE = 512  # the tiny tokenizer's
LAYERS = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
)
MLP_LAYERS = ("hash_moe", "moe", "hash_moe", "moe")
WINDOWS = {"small": (16, 4, 16), "real": (128, 4, 128)}  # sliding window, CSA rate, HCA rate
# the MTP module is fitted on greedy continuations of random prompts of 4-32 tokens
FIT_SEQUENCES, FIT_LENGTH, FIT_PROMPTS, FIT_STEPS = 32, 64, (4, 32), 120
BENCH_SIZE = {"hidden_size": 256, "head_dim": 64, "q_lora_rank": 96, "moe_intermediate_size": 128}


def config(windows: str = "small", **extra: Any) -> Any:
    """The checkpoint's `DeepseekV4Config`."""
    window, csa, hca = WINDOWS[windows]
    values: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": len(LAYERS),
        "num_attention_heads": 4,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "layer_types": list(LAYERS),
        "mlp_layer_types": list(MLP_LAYERS),
        "compress_rates": {"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
        "sliding_window": window,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 8,
        "hc_mult": 4,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "num_nextn_predict_layers": 1,
    }
    values.update(extra)
    return transformers.DeepseekV4Config(**values)


def build(
    out: Path,
    windows: str = "small",
    mtp: bool = False,
    seed: int = 0,
    bench_size: bool = False,
    fp8: bool = False,
) -> torch.nn.Module:
    """Write the checkpoint to `out`; returns the `transformers` model (float32)."""
    torch.manual_seed(seed)
    sizes: dict[str, Any] = dict(BENCH_SIZE) if bench_size else {}
    model = transformers.DeepseekV4ForCausalLM(config(windows, **sizes)).eval()
    randomise(model, model.config.n_routed_experts)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    shutil.copy(ensure_tiny_model() / "tokenizer.json", out / "tokenizer.json")
    if mtp:
        state = load_file(str(out / "model.safetensors"))
        state.update(mtp_module(model.config, seed))
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        fit_mtp(out, seed=seed)
    if fp8:
        quantize_attention(out)
    return model


def quantize_attention(out: Path) -> None:
    """Store the checkpoint's attention projections (`attn.w*.weight`, the compressors' and
    indexers' included) as FP8 blocks, and say so in its config."""
    state = load_file(str(out / "model.safetensors"))
    for name in [k for k in state if ".attn." in k and k.split(".")[-2].startswith("w")]:
        state[name], state[name + "_scale_inv"] = fp8_blocks(state[name])
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (out / "config.json").write_text(json.dumps(raw, indent=2))


def randomise(model: torch.nn.Module, experts: int) -> None:
    """Scale the projections up and draw the parameters transformers sets to constants."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.split(".")[-1]
            if leaf in ("sinks", "position_bias", "base", "hc_base"):
                param.normal_(0.0, 0.5)
            elif "norm" not in name and leaf not in ("scale", "hc_scale"):
                param.mul_(4.0)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.1)
            table = getattr(module, "tid2eid", None)
            if isinstance(table, torch.Tensor):
                table.copy_(torch.stack([torch.randperm(experts)[: table.shape[1]] for _ in table]))


def mtp_module(main: Any, seed: int) -> dict[str, torch.Tensor]:
    """Random `mtp.0.*` tensors: the block of a deeper model's extra sliding-window layer
    with scored experts, and the module's own projections, norms and `hc_head_*`."""
    torch.manual_seed(seed + 1)
    layers = main.num_hidden_layers
    values = {
        **main.to_dict(),
        "num_hidden_layers": layers + 1,
        "layer_types": [*main.layer_types, "sliding_attention"],
        "mlp_layer_types": [*main.mlp_layer_types, "moe"],
    }
    deeper = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**values)).eval()
    randomise(deeper, main.n_routed_experts)
    with tempfile.TemporaryDirectory() as saved:  # in the checkpoint's own names
        deeper.save_pretrained(saved)
        saved_state = load_file(str(Path(saved) / "model.safetensors"))
    prefix = f"model.layers.{layers}."
    state = {
        "mtp.0." + k.removeprefix(prefix): v.contiguous()
        for k, v in saved_state.items()
        if k.startswith(prefix)
    }
    hidden, n = main.hidden_size, main.hc_mult
    for name in ("e_proj", "h_proj"):
        state[f"mtp.0.{name}.weight"] = torch.randn(hidden, hidden) * hidden**-0.5
    for name in ("enorm", "hnorm", "norm"):
        state[f"mtp.0.{name}.weight"] = torch.ones(hidden)
    state["mtp.0.hc_head_fn"] = torch.randn(n, n * hidden) * 0.02
    state["mtp.0.hc_head_base"] = torch.zeros(n)
    state["mtp.0.hc_head_scale"] = torch.ones(1)
    return state


def fit_mtp(out: Path, steps: int = FIT_STEPS, seed: int = 0) -> float:
    """Train the checkpoint's MTP module to draft the main model's own greedy continuations,
    write it back; returns the draft accuracy on its training data."""
    loaded = load_model(out, "float32", torch.device("cpu"), FIT_LENGTH, mtp=True)
    model = loaded.model
    assert isinstance(model, DeepseekV4CausalLM) and model.mtp is not None
    sequences, hidden, generated = greedy_data(model, seed)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("mtp."))
    count = len(sequences)
    positions = torch.arange(FIT_LENGTH).expand(count, FIT_LENGTH)
    targets = torch.arange(FIT_LENGTH - 2).expand(count, -1)
    next_ids = torch.roll(sequences, -1, dims=1)
    launch = LaunchInputs(next_ids, positions, torch.arange(count), targets, FIT_LENGTH, 0)
    optimizer = torch.optim.Adam(model.mtp.parameters(), lr=3e-3)
    wanted = sequences[:, 2:][generated]
    with torch.enable_grad():
        for _ in range(steps):
            logits = model.draft_logits(launch, hidden, model.new_cache(count, FIT_LENGTH))
            loss = torch.nn.functional.cross_entropy(logits[generated], wanted)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        logits = model.draft_logits(launch, hidden, model.new_cache(count, FIT_LENGTH))
        accuracy = float((logits[generated].argmax(-1) == wanted).float().mean())
    state = load_file(str(out / "model.safetensors"))
    for name, tensor in model.mtp.state_dict().items():
        state[f"mtp.{name}"] = tensor.detach().clone().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return accuracy


def greedy_data(
    model: DeepseekV4CausalLM, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy continuations of random prompts [N, FIT_LENGTH], the main model's last-layer
    streams at each position, and which targets (token i+2 of each position i) the model
    generated rather than was given."""
    rng = random.Random(seed)
    shapes = LaunchShapes(FIT_SEQUENCES, FIT_LENGTH, 1, FIT_SEQUENCES, FIT_LENGTH, False)
    runner = LaunchRunner(model, shapes)
    lengths = [rng.randint(*FIT_PROMPTS) for _ in range(FIT_SEQUENCES)]
    tokens = [[rng.randrange(2, VOCAB_SIZE) for _ in range(n)] for n in lengths]
    last = [int(runner.prefill(slot, p, 0).argmax()) for slot, p in enumerate(tokens)]
    while True:
        live = [s for s in range(FIT_SEQUENCES) if len(tokens[s]) < FIT_LENGTH]
        for s in live:
            tokens[s].append(last[s])
        live = [s for s in live if len(tokens[s]) < FIT_LENGTH]
        if not live:
            break
        for group in (live[i : i + FIT_SEQUENCES] for i in range(0, len(live), FIT_SEQUENCES)):
            positions = [len(tokens[s]) - 1 for s in group]
            picked = runner.decode(group, [last[s] for s in group], positions).argmax(-1)
            for s, token in zip(group, picked.tolist()):
                last[s] = token
    hidden = torch.cat([runner.prefill_launch(s, seq, 0).hidden for s, seq in enumerate(tokens)])
    targets = torch.arange(2, FIT_LENGTH)
    generated = targets[None, :] >= torch.tensor(lengths)[:, None]
    return torch.tensor(tokens), hidden.clone(), generated


def main() -> None:
    """Write the checkpoint named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--windows", choices=sorted(WINDOWS), default="small")
    parser.add_argument("--mtp", action="store_true", help="add a fitted MTP module")
    parser.add_argument("--fp8", action="store_true", help="attention weights as FP8 blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench", action="store_true", help="a few million parameters")
    args = parser.parse_args()
    build(args.out, args.windows, args.mtp, args.seed, bench_size=args.bench, fp8=args.fp8)
    print(args.out)


if __name__ == "__main__":
    main()
