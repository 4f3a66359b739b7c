"""The DeepSeek-V4 family (`DeepseekV4ForCausalLM`: V4-Flash and V4-Pro): sliding,
compressed-sparse and heavily compressed attention over per-slot state (attention.py,
state.py), hyper-connections and hash-routed and scored MoE (blocks.py), its MTP module
(model.py); its checkpoint, rotary tables and the state's size: config.py."""

from __future__ import annotations

import torch

from npu_worker.models.deepseek_v4.config import (
    ARCHITECTURE,
    MODEL_TYPE,
    DeepseekV4Config,
    checkpoint_name,
    expert_of,
)
from npu_worker.models.deepseek_v4.model import DeepseekV4CausalLM
from npu_worker.models.family import Family
from npu_worker.models.kit import LayerKit


def build(
    config: DeepseekV4Config, max_positions: int, mtp: bool, experts: range, kit: LayerKit
) -> DeepseekV4CausalLM:
    """The decoder, head (+ MTP module) with this rank's routed experts."""
    return DeepseekV4CausalLM(config, max_positions, with_mtp=mtp, experts=experts, kit=kit)


class V4Placement:
    """transformers' names, or DeepSeek's release names mapped to them; the MTP module's
    tensors only with MTP; of the routed experts, this rank's share."""

    def __init__(self, config: DeepseekV4Config, experts: range, mtp: bool) -> None:
        self.experts, self.mtp = experts, mtp

    def keep(self, key: str) -> bool:
        """The main model's tensors (the MTP module's, with MTP); this rank's experts."""
        expert = expert_of(key)
        return (self.mtp or not key.startswith("mtp.")) and (
            expert is None or expert in self.experts
        )

    def name(self, key: str) -> str | None:
        """The model's name (`checkpoint_name`)."""
        return checkpoint_name(key)

    def finish(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` as it is."""
        return state


FAMILY = Family(
    name="deepseek_v4",
    architectures=(ARCHITECTURE,),
    model_types=(MODEL_TYPE,),
    read_config=DeepseekV4Config.from_dir,
    build=build,
    placement=V4Placement,
    num_experts=lambda config: config.n_routed_experts,
)
