"""A small random DeepSeek-V3 checkpoint written by `transformers` (a test and bench
dependency), with the tiny model's byte-level tokenizer, for the tests and `npu-pool bench`:

    python -m npu_worker.weights.makers.deepseek_v3 DIR [--no-q-lora] [--mtp] [--fp8] [--bench]
                                                     [--experts 8]

Weights are scaled up so greedy top-1/top-2 logit margins are clear (a random model's are
near 3e-4) and the router's correction bias is random, so routing is not uniform. With
`--mtp` the checkpoint also gets an MTP layer (`model.layers.{num_hidden_layers}.*`: a
MoE decoder block, `enorm`, `hnorm`, `eh_proj`, `shared_head`), which `transformers` itself
neither builds nor saves, fitted to draft the model's own greedy continuations (as the
`tiny` preset's MTP module is). With `--fp8` every projection is stored as float8 e4m3 with
128x128 block scales (`weight_scale_inv`), as DeepSeek releases its weights.
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

from npu_worker.models.deepseek_v3.model import DeepseekV3CausalLM
from npu_worker.models.launch import LaunchInputs
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from npu_worker.weights.tiny import ensure_tiny_model
from schemas.control import PrefillChunk
from schemas.registry import LaunchShapes

VOCAB_SIZE = 512  # the tiny tokenizer's
# `--bench`: a few million parameters in the same layout, for `npu-pool bench`
BENCH_SIZE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "num_experts_per_tok": 4,
}
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8 e4m3 value
# the MTP layer is fitted on this many greedy continuations of random prompts of 4-48 tokens
FIT_SEQUENCES, FIT_LENGTH, FIT_PROMPTS = 64, 96, (4, 48)


def config(q_lora: bool = True, experts: int = 8, layers: int = 3, **extra: Any) -> Any:
    """The checkpoint's `DeepseekV3Config`: every V3 feature present (q LoRA or not, YaRN,
    grouped routing, shared experts, a dense first layer)."""
    values: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 24 if q_lora else None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 2048,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "num_nextn_predict_layers": 1,
    }
    values.update(extra)
    return transformers.DeepseekV3Config(**values)


def build(
    out: Path,
    q_lora: bool = True,
    mtp: bool = False,
    fp8: bool = False,
    experts: int = 8,
    layers: int = 3,
    seed: int = 0,
    bench_size: bool = False,
) -> torch.nn.Module:
    """Write the checkpoint to `out`; returns the `transformers` model (float32)."""
    if mtp and fp8:
        raise ValueError("an FP8 checkpoint with a fitted MTP layer is not built here")
    torch.manual_seed(seed)
    sizes: dict[str, Any] = dict(BENCH_SIZE) if bench_size else {}
    if not q_lora:
        sizes = {**sizes, "q_lora_rank": None}
    model = transformers.DeepseekV3ForCausalLM(config(q_lora, experts, layers, **sizes)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.1)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    shutil.copy(ensure_tiny_model() / "tokenizer.json", out / "tokenizer.json")
    state = load_file(str(out / "model.safetensors"))
    if mtp:
        state.update(mtp_layer(model.config, layers, seed))
    if fp8:
        state = quantized(state)
        raw = json.loads((out / "config.json").read_text())
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
        (out / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if mtp:
        fit_mtp(out, seed=seed)
    return model


def mtp_layer(main: Any, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP-layer tensors under `model.layers.{layers}.*`: the block of a deeper model
    (a MoE layer), `enorm`, `hnorm`, `eh_proj` and `shared_head` (norm and head)."""
    torch.manual_seed(seed + 1)
    values = {**main.to_dict(), "num_hidden_layers": layers + 1}
    deeper = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**values)).eval()
    with tempfile.TemporaryDirectory() as saved:  # saved as checkpoints name experts
        deeper.save_pretrained(saved)
        saved_state = load_file(str(Path(saved) / "model.safetensors"))
    prefix = f"model.layers.{layers}."
    state = {}
    for name, tensor in saved_state.items():
        if name.startswith(prefix):
            scale = 1.0 if "norm" in name or "e_score" in name else 4.0
            state[name] = (tensor * scale).contiguous()
    hidden = deeper.config.hidden_size
    state[prefix + "enorm.weight"] = torch.ones(hidden)
    state[prefix + "hnorm.weight"] = torch.ones(hidden)
    state[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * (2 * hidden) ** -0.5
    state[prefix + "shared_head.norm.weight"] = torch.ones(hidden)
    state[prefix + "shared_head.head.weight"] = torch.randn(VOCAB_SIZE, hidden) * 0.08
    state[prefix + "embed_tokens.weight"] = deeper.model.embed_tokens.weight.detach().clone()
    return state


def fit_mtp(out: Path, steps: int = 200, seed: int = 0) -> float:
    """Train the checkpoint's MTP layer to draft the main model's own greedy continuations
    (as `tiny`'s is), write it back; returns the draft accuracy on its training data."""
    loaded = load_model(out, "float32", torch.device("cpu"), FIT_LENGTH, mtp=True)
    model = loaded.model
    assert isinstance(model, DeepseekV3CausalLM) and model.mtp is not None
    sequences, hidden, generated = greedy_data(model, seed)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("mtp."))
    mtp = model.mtp
    positions = torch.arange(FIT_LENGTH).expand(len(sequences), FIT_LENGTH)
    launch = LaunchInputs(sequences, positions, torch.arange(len(sequences)), positions, 0, None)
    cos, sin = model.rope(positions)
    optimizer = torch.optim.Adam(mtp.parameters(), lr=3e-3)
    with torch.enable_grad():
        for _ in range(steps):
            logits = draft_logits(model, sequences, hidden, cos, sin, launch)
            loss = torch.nn.functional.cross_entropy(  # only tokens the model chose
                logits[generated], sequences[:, 2:][generated]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        logits = draft_logits(model, sequences, hidden, cos, sin, launch)
        right = logits.argmax(-1) == sequences[:, 2:]
        accuracy = float(right[generated].float().mean())
    prefix = f"model.layers.{model.config.num_layers}."
    fitted = {
        prefix + name.removeprefix("mtp.").removeprefix("block."): tensor.detach().clone()
        for name, tensor in model.state_dict().items()
        if name.startswith("mtp.")
    }
    state = load_file(str(out / "model.safetensors"))
    state.update(fitted)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return accuracy


def greedy_data(
    model: DeepseekV3CausalLM, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy continuations of random prompts [N, FIT_LENGTH], their final hidden states, and
    which targets (token i+2 of each position i) the model generated rather than was given."""
    rng = random.Random(seed)
    shapes = LaunchShapes(FIT_SEQUENCES, FIT_LENGTH, 1, FIT_SEQUENCES, FIT_LENGTH, False)
    runner = LaunchRunner(model, shapes)
    lengths = [rng.randint(*FIT_PROMPTS) for _ in range(FIT_SEQUENCES)]
    tokens = [[rng.randrange(2, VOCAB_SIZE) for _ in range(n)] for n in lengths]
    last = [
        int(runner.prefill([PrefillChunk(slot, 0, len(p))], [p]).logits.argmax())
        for slot, p in enumerate(tokens)
    ]
    while True:
        live = [s for s in range(FIT_SEQUENCES) if len(tokens[s]) < FIT_LENGTH]
        for s in live:
            tokens[s].append(last[s])
        live = [s for s in live if len(tokens[s]) < FIT_LENGTH]
        if not live:
            break
        positions = [len(tokens[s]) - 1 for s in live]
        picked = runner.decode(live, [last[s] for s in live], positions).argmax(-1).tolist()
        for s, token in zip(live, picked):
            last[s] = token
    hidden = torch.cat(
        [
            runner.prefill([PrefillChunk(s, 0, len(seq))], [seq]).hidden
            for s, seq in enumerate(tokens)
        ]
    )
    targets = torch.arange(2, FIT_LENGTH)
    generated = targets[None, :] >= torch.tensor(lengths)[:, None]
    return torch.tensor(tokens), hidden.clone(), generated


def draft_logits(
    model: DeepseekV3CausalLM,
    sequences: torch.Tensor,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    launch: LaunchInputs,
) -> torch.Tensor:
    """The MTP layer's logits for token i+2 from hidden state i and token i+1."""
    mtp = model.mtp
    assert mtp is not None
    embedded = model.model.embed_tokens(torch.roll(sequences, -1, dims=1)).detach()
    x = mtp.eh_proj(torch.cat((mtp.enorm(embedded), mtp.hnorm(hidden)), dim=-1))
    x = mtp.shared_head.norm(mtp.block(x, cos, sin, launch, None))
    return mtp.shared_head.head(x[:, : FIT_LENGTH - 2])


def quantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every projection weight as float8 e4m3 with per-128x128-block `weight_scale_inv`
    (the rest — embeddings, norms, the router — kept as they are)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not (name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")):
            out[name] = tensor
            continue
        out[name], out[name + "_scale_inv"] = fp8_blocks(tensor)
    return out


def fp8_blocks(
    tensor: torch.Tensor, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as float8 e4m3 and its per-128x128-block scales: float32, or with
    `power_of_two` the next power of two up, stored as float8 e8m0 (`scale_fmt: ue8m0`)."""
    rows, cols = tensor.shape
    blocks_r, blocks_c = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(blocks_r * FP8_BLOCK, blocks_c * FP8_BLOCK)
    padded[:rows, :cols] = tensor
    tiles = padded.view(blocks_r, FP8_BLOCK, blocks_c, FP8_BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scaled = (tiles / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    stored = scale.to(torch.float8_e8m0fnu) if power_of_two else scale.float()
    return scaled.to(torch.float8_e4m3fn), stored


def main() -> None:
    """Write the checkpoint named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--no-q-lora", action="store_true", help="one q_proj (V2-Lite form)")
    parser.add_argument("--mtp", action="store_true", help="add an MTP layer")
    parser.add_argument("--fp8", action="store_true", help="store projections as FP8 blocks")
    parser.add_argument("--experts", type=int, default=8, help="routed experts per layer")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench", action="store_true", help="a few million parameters")
    args = parser.parse_args()
    build(
        args.out,
        not args.no_q_lora,
        args.mtp,
        args.fp8,
        args.experts,
        args.layers,
        args.seed,
        bench_size=args.bench,
    )
    print(args.out)


if __name__ == "__main__":
    main()
