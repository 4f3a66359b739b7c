"""A small random DeepSeek-V4 checkpoint written by `transformers` (a test and bench
dependency), with the tiny model's byte-level tokenizer, for the tests and `npu-pool bench`:

    python -m npu_worker.weights.makers.deepseek_v4 DIR [--windows small|real] [--mtp]
                                                     [--fp8] [--release] [--bench]

Every layer type is present (sliding, CSA, HCA) and both MoE kinds (hash-routed first, then
scored). `--windows small` uses a 16-token window and compress rates 4/16, so short prompts
cross many window boundaries; `--windows real` the V4-Flash values 128/4/128. Weights are
scaled up so greedy top-1/top-2 logit margins are clear, and the parameters transformers
initialises to constants (sinks, `ape`, hyper-connection bases, router biases, `tid2eid`)
are random, so each of them matters to the tokens. With `--mtp` the checkpoint also gets
an MTP module (`mtp.0.*`: a sliding-window block with scored experts, `e_proj`, `h_proj`,
`enorm`, `hnorm`, `norm`, `hc_head_*`), which transformers neither builds nor saves, fitted
to draft the model's own greedy continuations; such a checkpoint's embedding is scaled up
(`MTP_EMBED_SCALE`) so that, as in a language model, the next token often follows from the
last one and a draft two tokens ahead can be learnt (its drafts are right for 58% of
held-out tokens; the build prints both accuracies). With `--fp8` the attention projections
are stored as float8 e4m3 with 128x128 block scales (`weight_scale_inv`, as transformers
names them), as DeepSeek releases V4's attention weights. With `--release` the checkpoint
is written in DeepSeek's own release layout: bare names (`embed.`, `layers.`, `hc_head_*`),
a config in the release's terms (`compress_ratios`, `num_hash_layers`, flat rope keys) and,
with `--fp8`, UE8M0 scales beside each FP8 weight as `X.scale`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from npu_worker.models.deepseek_v4.model import DeepseekV4CausalLM
from npu_worker.models.launch import LaunchInputs
from npu_worker.models.stored import FP4_VALUES, MX_BLOCK
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from npu_worker.weights.makers.deepseek_v3 import fp8_blocks
from npu_worker.weights.tiny import ensure_tiny_model
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes

VOCAB_SIZE = 512  # the tiny tokenizer's
LAYERS = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
)
MLP_LAYERS = ("hash_moe", "moe", "hash_moe", "moe")
HASH_FIRST = ("hash_moe", "hash_moe", "moe", "moe")  # as DeepSeek's release counts them
WINDOWS = {"small": (16, 4, 16), "real": (128, 4, 128)}  # sliding window, CSA rate, HCA rate
# the MTP module is fitted on greedy continuations of random prompts of 4-32 tokens
FIT_SEQUENCES, FIT_LENGTH, FIT_PROMPTS, FIT_STEPS = 32, 64, (4, 32), 120
# the embedding's scale in a checkpoint with an MTP module: 10 gives a held-out draft acceptance
# of about 60% (3: 5%, the module memorises its fitting data; 30: 93%, the layers barely matter)
MTP_EMBED_SCALE = 10.0
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
BENCH_SIZE = {"hidden_size": 256, "head_dim": 64, "q_lora_rank": 96, "moe_intermediate_size": 128}


def config(windows: str = "small", mlp_layers: tuple[str, ...] = MLP_LAYERS, **extra: Any) -> Any:
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
        "mlp_layer_types": list(mlp_layers),
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
    fit: Fit | None = None,
    mlp_layers: tuple[str, ...] = MLP_LAYERS,
    release: bool = False,
    sizes: dict[str, Any] | None = None,
    fp4_experts: bool = False,
) -> torch.nn.Module:
    """Write the checkpoint to `out` (with `release`, in DeepSeek's release layout, its
    hash-routed layers first, and with `fp4_experts` its routed experts as MXFP4; `sizes`:
    config values over the tiny or bench sizes); returns the `transformers` model
    (float32)."""
    torch.manual_seed(seed)
    sizes = {**(BENCH_SIZE if bench_size else {}), **(sizes or {})}
    if release:
        mlp_layers = HASH_FIRST
    model = transformers.DeepseekV4ForCausalLM(config(windows, mlp_layers, **sizes)).eval()
    randomise(model, model.config.n_routed_experts, MTP_EMBED_SCALE if mtp else 1.0)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    shutil.copy(ensure_tiny_model() / "tokenizer.json", out / "tokenizer.json")
    if mtp:
        state = load_file(str(out / "model.safetensors"))
        state.update(mtp_module(model.config, seed))
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        fitted, held_out = fit_mtp(out, seed=seed, fit=fit)
        print(f"MTP draft accuracy: {fitted:.1%} on its fitting data, {held_out:.1%} held out")
    if release:
        release_layout(out, out, fp8, fp4_experts)
    elif fp8:
        quantize_attention(out)
    return model


def attention_projections(state: dict[str, torch.Tensor]) -> list[str]:
    """The attention projections' weights (`attn.w*.weight`, the compressors' and indexers'
    included): what DeepSeek stores as FP8 blocks."""
    return [k for k in state if ".attn." in k and k.split(".")[-2].startswith("w")]


def release_layout(src: Path, out: Path, fp8: bool = False, fp4_experts: bool = False) -> None:
    """Write the checkpoint at `src` to `out` as DeepSeek releases V4: bare tensor names
    (`embed.`, `layers.`, `norm.`, `head.`, `hc_head_*`), a config in the release's terms
    (`compress_ratios` with the MTP block's trailing 0, `num_hash_layers`,
    `qk_rope_head_dim`, flat `rope_theta` / `compress_rope_theta` / `rope_scaling`) and,
    with `fp8`, the attention projections as float8 e4m3 with power-of-two block scales
    beside them as `X.scale` (float8 e8m0, `scale_fmt: ue8m0`); with `fp4_experts`, the
    routed experts as MXFP4 (`mxfp4_blocks`, `expert_dtype: fp4`). The hash-routed layers
    must come first, as `num_hash_layers` counts them."""
    raw = json.loads((src / "config.json").read_text())
    kinds = raw.pop("layer_types")
    rates = raw.pop("compress_rates")
    mlp = raw.pop("mlp_layer_types")
    hashed = mlp.count("hash_moe")
    if mlp != ["hash_moe"] * hashed + ["moe"] * (len(mlp) - hashed):
        raise ValueError(f"{src}: hash-routed layers {mlp} do not come first")
    rope = raw.pop("rope_parameters")
    raw.pop("partial_rotary_factor", None)
    compress = rope["compress"]
    raw |= {
        "compress_ratios": [rates.get(k, 0) for k in kinds] + [0] * raw["num_nextn_predict_layers"],
        "num_hash_layers": hashed,
        "rope_theta": rope["main"]["rope_theta"],
        "compress_rope_theta": compress["rope_theta"],
        "rope_scaling": {
            "type": "yarn",
            **{k: compress[k] for k in YARN_KEYS},
        },
    }
    state = {release_name(k): v for k, v in load_file(str(src / "model.safetensors")).items()}
    if fp8:
        for name in attention_projections(state):
            weight, scale = fp8_blocks(state[name], power_of_two=True)
            state[name], state[name.removesuffix(".weight") + ".scale"] = weight, scale
    if fp4_experts:
        for name in [k for k in state if ".ffn.experts." in k and k.endswith(".weight")]:
            weight, scale = mxfp4_blocks(state[name])
            state[name], state[name.removesuffix(".weight") + ".scale"] = weight, scale
        raw["expert_dtype"] = "fp4"
    if fp8 or fp4_experts:
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    tokenizer = (src / "tokenizer.json").read_bytes()
    shutil.rmtree(out, ignore_errors=True)  # `out` may be `src`: everything is read by now
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    (out / "tokenizer.json").write_bytes(tokenizer)


def mxfp4_blocks(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] (in a multiple of 32) as MXFP4, as the OCP MX format makes it:
    each 32 inputs share the power of two 2^(floor(log2 max |x|) - 2), and each value is
    the nearest e2m1 value of x over it (ties to the lower magnitude, past 6 clamped).
    Returns the e2m1 pairs (`float4_e2m1fn_x2`, the even input in the low nibble)
    [out, in / 2] and the powers' UE8M0 bytes (`float8_e8m0fnu`) [out, in / 32]."""
    rows, cols = tensor.shape
    if cols % MX_BLOCK:
        raise ValueError(f"MXFP4 needs inputs in multiples of {MX_BLOCK}, not {cols}")
    blocks = tensor.float().view(rows, cols // MX_BLOCK, MX_BLOCK)
    largest = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-125)
    exponent = torch.floor(torch.log2(largest)) - 2  # e2m1's largest power of two is 2^2
    scaled = blocks / torch.exp2(exponent)
    table = torch.tensor(FP4_VALUES)
    codes = (scaled.abs().clamp(max=6.0)[..., None] - table).abs().argmin(dim=-1)
    nibbles = (codes | ((scaled < 0).long() << 3)).view(rows, cols).to(torch.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    scale = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return packed.view(torch.float4_e2m1fn_x2), scale.view(torch.float8_e8m0fnu)


def release_name(key: str) -> str:
    """A tensor's name in DeepSeek's V4 release, from its name as transformers saves it."""
    for part in ("fn", "base", "scale"):
        if key == f"model.hc_head.hc_{part}":
            return f"hc_head_{part}"
    return key.removeprefix("model.").replace("embed_tokens.", "embed.", 1)


def quantize_attention(out: Path) -> None:
    """Store the checkpoint's attention projections (`attn.w*.weight`, the compressors' and
    indexers' included) as FP8 blocks, and say so in its config."""
    state = load_file(str(out / "model.safetensors"))
    for name in attention_projections(state):
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


def randomise(model: torch.nn.Module, experts: int, embed_scale: float = 1.0) -> None:
    """Scale the projections up (the embedding `embed_scale` times more) and draw the
    parameters transformers sets to constants."""
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
        dict(model.named_parameters())["model.embed_tokens.weight"].mul_(embed_scale)


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


@dataclass(frozen=True)
class Fit:
    """How the MTP module is fitted: on `sequences` greedy continuations of `length` tokens
    from random prompts of `prompts` tokens, `steps` Adam steps over minibatches of `batch`
    sequences (all of them when `batch` is 0)."""

    sequences: int = FIT_SEQUENCES
    length: int = FIT_LENGTH
    prompts: tuple[int, int] = FIT_PROMPTS
    steps: int = FIT_STEPS
    batch: int = 0
    lr: float = 3e-3


HELD_OUT = Fit(sequences=12, length=160, prompts=(5, 100))  # other prompts, longer


def fit_mtp(
    out: Path, steps: int = FIT_STEPS, seed: int = 0, fit: Fit | None = None
) -> tuple[float, float]:
    """Train the checkpoint's MTP module to draft the main model's own greedy continuations,
    write it back; returns the draft accuracy on its training data and on held-out
    continuations (`HELD_OUT`, other prompts)."""
    fit = fit or Fit(steps=steps)
    loaded = load_model(
        out, "float32", torch.device("cpu"), max(fit.length, HELD_OUT.length), mtp=True
    )
    model = loaded.model
    assert isinstance(model, DeepseekV4CausalLM) and model.mtp is not None
    sequences, hidden, generated = greedy_data(model, seed, fit)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("mtp."))
    count = len(sequences)
    batch = fit.batch or count
    wanted = sequences[:, 2:]
    optimizer = torch.optim.Adam(model.mtp.parameters(), lr=fit.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, fit.steps))
    order = torch.Generator().manual_seed(seed)
    every = torch.arange(count)
    with torch.enable_grad():
        for _ in range(fit.steps):
            rows = torch.randperm(count, generator=order)[:batch] if fit.batch else every
            logits = draft_logits(model, sequences[rows], hidden[rows])
            loss = torch.nn.functional.cross_entropy(
                logits[generated[rows]], wanted[rows][generated[rows]]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if fit.batch:
                schedule.step()
    state = load_file(str(out / "model.safetensors"))
    for name, tensor in model.mtp.state_dict().items():
        state[f"mtp.{name}"] = tensor.detach().clone().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    fitted = draft_accuracy(model, sequences, hidden, generated, batch)
    held_out = draft_accuracy(model, *greedy_data(model, seed + 1, HELD_OUT), HELD_OUT.sequences)
    return fitted, held_out


def draft_logits(
    model: DeepseekV4CausalLM, sequences: torch.Tensor, hidden: torch.Tensor
) -> torch.Tensor:
    """The MTP module's logits for token i+2 of each position i of `sequences` [N, L], from
    the main model's streams `hidden` and token i+1."""
    n, length = sequences.shape
    positions = torch.arange(length).expand(n, length)
    targets = torch.arange(length - 2).expand(n, -1)
    next_ids = torch.roll(sequences, -1, dims=1)
    launch = LaunchInputs(next_ids, positions, torch.arange(n), targets, length, 0)
    return model.draft_logits(launch, hidden, model.new_state(n, length))


def draft_accuracy(
    model: DeepseekV4CausalLM,
    sequences: torch.Tensor,
    hidden: torch.Tensor,
    generated: torch.Tensor,
    batch: int,
) -> float:
    """The share of generated tokens the MTP module drafts right (greedy)."""
    right = total = 0
    with torch.no_grad():
        for start in range(0, len(sequences), batch):
            rows = slice(start, start + batch)
            picked = draft_logits(model, sequences[rows], hidden[rows])[generated[rows]]
            wanted = sequences[rows, 2:][generated[rows]]
            right += int((picked.argmax(-1) == wanted).sum())
            total += len(wanted)
    return right / max(1, total)


def greedy_data(
    model: DeepseekV4CausalLM, seed: int, fit: Fit | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy continuations of random prompts [N, length], the main model's last-layer
    streams at each position, and which targets (token i+2 of each position i) the model
    generated rather than was given."""
    fit = fit or Fit()
    rng = random.Random(seed)
    count, length = fit.sequences, fit.length
    rows = min(count, FIT_SEQUENCES)  # decode rows per launch
    shapes = LaunchShapes(rows, length, 1, count, length, False)
    runner = LaunchRunner(model, shapes)
    lengths = [rng.randint(*fit.prompts) for _ in range(count)]
    tokens = [[rng.randrange(2, VOCAB_SIZE) for _ in range(n)] for n in lengths]
    last = [
        int(runner.prefill([PrefillChunk(slot, 0, len(p))], [p]).logits.argmax())
        for slot, p in enumerate(tokens)
    ]
    while True:
        live = [s for s in range(count) if len(tokens[s]) < length]
        for s in live:
            tokens[s].append(last[s])
        live = [s for s in live if len(tokens[s]) < length]
        if not live:
            break
        for group in (live[i : i + rows] for i in range(0, len(live), rows)):
            positions = [len(tokens[s]) - 1 for s in group]
            picked = runner.decode(group, [last[s] for s in group], positions).argmax(-1)
            for s, token in zip(group, picked.tolist()):
                last[s] = token
    hidden = torch.cat(
        [
            runner.prefill([PrefillChunk(s, 0, len(seq))], [seq]).hidden
            for s, seq in enumerate(tokens)
        ]
    )
    targets = torch.arange(2, length)
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
    parser.add_argument(
        "--release", action="store_true", help="DeepSeek's release layout (names, config, scales)"
    )
    parser.add_argument(
        "--fp4-experts", action="store_true", help="with --release: routed experts as MXFP4"
    )
    fitting = parser.add_argument_group("MTP fitting (with --mtp; defaults: the tests' fit)")
    fitting.add_argument("--fit-sequences", type=int, default=FIT_SEQUENCES)
    fitting.add_argument("--fit-length", type=int, default=FIT_LENGTH, help="tokens a sequence")
    fitting.add_argument("--fit-prompts", type=int, nargs=2, default=FIT_PROMPTS)
    fitting.add_argument("--fit-steps", type=int, default=FIT_STEPS)
    fitting.add_argument("--fit-batch", type=int, default=0, help="sequences a step (0: all)")
    fitting.add_argument("--fit-lr", type=float, default=3e-3)
    args = parser.parse_args()
    fit = Fit(
        args.fit_sequences,
        args.fit_length,
        (args.fit_prompts[0], args.fit_prompts[1]),
        args.fit_steps,
        args.fit_batch,
        args.fit_lr,
    )
    build(
        args.out,
        args.windows,
        args.mtp,
        args.seed,
        args.bench,
        args.fp8,
        fit,
        release=args.release,
        fp4_experts=args.fp4_experts,
    )
    print(args.out)


if __name__ == "__main__":
    main()
