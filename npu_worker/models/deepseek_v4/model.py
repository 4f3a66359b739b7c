"""DeepSeek-V4 (`DeepseekV4ForCausalLM`, `model_type: deepseek_v4`; DeepSeek-V4-Flash and
V4-Pro) over fixed per-slot state (state.py).

- Attention by `layer_types`: sliding-window, compressed sparse (CSA) and heavily
  compressed (HCA), single K=V head with per-head sinks (attention.py).
- Hyper-connections (`hc_mult` residual streams) and hash-routed and scored MoE
  (blocks.py).
- The MTP module (`mtp.0.*`, which transformers neither builds nor saves; as DeepSeek's own
  V4 inference code has it): from the main model's last-layer streams at position i
  (before `hc_head`) and the embedding of token i+1, `e_proj(enorm(embed)) +
  h_proj(hnorm(streams))` on every stream, one sliding-window block with scored experts,
  its own `hc_head_*` and `norm`, and the main model's head predict token i+2. Its block
  keeps its own sliding window (state layer `num_layers`); the embedding and head are the
  main model's.

Module names follow the checkpoint as transformers saves it (`attn.wq_a`, `ffn.gate.tid2eid`,
`hc_attn_fn`, `head`, ...), so its state dict loads as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from npu_worker.models.deepseek_v4.attention import Launch
from npu_worker.models.deepseek_v4.blocks import Block, HyperHead, hyper_head
from npu_worker.models.deepseek_v4.config import DeepseekV4Config, rope_table
from npu_worker.models.deepseek_v4.state import DeepseekV4State
from npu_worker.models.kit import LayerKit, TorchKit
from npu_worker.models.launch import LaunchInputs, LaunchModel, LaunchOutput
from npu_worker.models.moe import ExpertModel

FLOAT32_PARTS = ("norm", "attn_sink", "ape", "hc_", "ffn.gate.")  # ffn.gate: the routers


class Backbone(nn.Module):
    def __init__(self, config: DeepseekV4Config, share: range, kit: LayerKit) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, share, kit) for i in range(config.num_layers))
        self.hc_head = HyperHead(config)
        self.norm = kit.rms_norm(config.hidden_size, config.rms_norm_eps, float32_weight=True)


class MTPBlock(Block):
    """The MTP module's block, with its input projections and its own `hc_head` and norm."""

    def __init__(self, config: DeepseekV4Config, share: range, kit: LayerKit) -> None:
        super().__init__(config, config.num_layers, share, kit)
        hidden, n, eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        self.e_proj = kit.linear(hidden, hidden)
        self.h_proj = kit.linear(hidden, hidden)
        self.enorm = kit.rms_norm(hidden, eps, float32_weight=True)
        self.hnorm = kit.rms_norm(hidden, eps, float32_weight=True)
        self.norm = kit.rms_norm(hidden, eps, float32_weight=True)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * hidden))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))


class DeepseekV4CausalLM(LaunchModel[DeepseekV4State], ExpertModel):
    """Decoder + LM head over per-slot state; each call runs one fixed-shape launch. Its
    prefill launches carry one request each (`packs` False). Its layers come from `kit`
    (plain torch layers by default)."""

    packs = False
    head_key = "head.weight"

    def __init__(
        self,
        config: DeepseekV4Config,
        max_positions: int,
        with_mtp: bool = False,
        experts: range | None = None,
        kit: LayerKit | None = None,
    ) -> None:
        super().__init__()
        share = range(config.n_routed_experts) if experts is None else experts
        kit = kit or TorchKit()
        self.config, self.kit = config, kit
        self.model = Backbone(config, share, kit)
        self.head = kit.linear(config.hidden_size, config.vocab_size)
        self.mtp = nn.ModuleList([MTPBlock(config, share, kit)]) if with_mtp else None
        for name, rope in (("main", config.main_rope), ("compress", config.compress_rope)):
            cos, sin = rope_table(rope, config.rope_dim, max_positions)
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)

    mtp: nn.ModuleList | None
    main_cos: torch.Tensor
    main_sin: torch.Tensor
    compress_cos: torch.Tensor
    compress_sin: torch.Tensor

    def output_head(self) -> nn.Linear:
        """`head`."""
        return self.head

    def input_embeddings(self) -> nn.Embedding:
        """`model.embed_tokens`."""
        return self.model.embed_tokens

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move to `device` in `dtype`, except what V4 keeps in float32: norms, sinks,
        `ape`, hyper-connection weights, routers and the rotary tables."""
        kept = {
            name: param.detach().float().clone()
            for name, param in self.named_parameters()
            if any(part in name for part in FLOAT32_PARTS)
        }
        self.to(device=device, dtype=dtype).eval()
        for name, param in self.named_parameters():
            if name in kept:
                param.data = kept[name].to(device)
        for buffer in ("main_cos", "main_sin", "compress_cos", "compress_sin"):
            setattr(self, buffer, getattr(self, buffer).float())

    def new_state(
        self, num_slots: int, max_kv_len: int, block_size: int = 0, num_blocks: int = 0
    ) -> DeepseekV4State:
        """Every slot's window rings, compressed entries and compressor rings (the entries
        and index keys in a cache of blocks when `num_blocks` > 0)."""
        weight = self.input_embeddings().weight  # the model's dtype and device
        return DeepseekV4State(
            self.config,
            num_slots,
            max_kv_len,
            weight.dtype,
            weight.device,
            self.mtp is not None,
            block_size,
            num_blocks,
        )

    def ropes(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The rotary tables by name: `main` for sliding layers, `compress` for the rest."""
        return {
            "main": (self.main_cos, self.main_sin),
            "compress": (self.compress_cos, self.compress_sin),
        }

    @torch.inference_mode()
    def forward(self, launch: LaunchInputs, state: DeepseekV4State) -> LaunchOutput:
        """Run one launch; `hidden` holds the streams before `hc_head`, [B, S, n * H]."""
        at = Launch(launch, state)
        x = self.model.embed_tokens(launch.input_ids)
        streams = x.float()[:, :, None].expand(-1, -1, self.config.hc_mult, -1).contiguous()
        ropes = self.ropes()
        for layer in self.model.layers:
            streams = layer(streams, launch.input_ids, at, state, ropes)
        hidden = self.model.norm(self.model.hc_head(streams, x.dtype))
        rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
        logits = self.head(hidden[rows, launch.logit_index]).float()
        return LaunchOutput(logits, streams.flatten(2))

    @torch.inference_mode()
    def draft(
        self, launch: LaunchInputs, hidden: torch.Tensor, state: DeepseekV4State
    ) -> torch.Tensor:
        """MTP logits [B, K, vocab]: `launch.input_ids` hold token i+1 for each position i,
        whose main-model streams are `hidden` [B, S, n * H]."""
        return self.draft_logits(launch, hidden, state)

    def draft_logits(
        self, launch: LaunchInputs, hidden: torch.Tensor, state: DeepseekV4State
    ) -> torch.Tensor:
        """`draft` without inference mode, for fitting the MTP module."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP module")
        mtp: MTPBlock = self.mtp[0]  # type: ignore[assignment]
        c = self.config
        batch, seq = launch.input_ids.shape
        streams = hidden.view(batch, seq, c.hc_mult, c.hidden_size)
        embedded = mtp.enorm(self.model.embed_tokens(launch.input_ids))
        dtype = embedded.dtype
        x = mtp.e_proj(embedded)[:, :, None] + mtp.h_proj(mtp.hnorm(streams).to(dtype))
        x = mtp(x.float(), launch.input_ids, Launch(launch, state), state, self.ropes())
        head = hyper_head(x, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, c, dtype)
        out = mtp.norm(head)
        rows = torch.arange(batch, device=out.device)[:, None]
        return self.head(out[rows, launch.logit_index]).float()
