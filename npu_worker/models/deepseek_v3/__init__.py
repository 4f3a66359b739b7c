"""The DeepSeek-V3 family (`DeepseekV3ForCausalLM`: DeepSeek-V3/R1 and checkpoints on its
architecture): latent attention over a latent cache, grouped-routing MoE, its MTP layer
(model.py; its config, YaRN tables and tensor names: config.py)."""

from __future__ import annotations

import torch

from npu_worker.models.deepseek_v3.config import (
    ARCHITECTURE,
    MODEL_TYPE,
    DeepseekV3Config,
    checkpoint_name,
    expert_of,
)
from npu_worker.models.deepseek_v3.model import DeepseekV3CausalLM
from npu_worker.models.family import Family
from npu_worker.models.kit import LayerKit


def build(
    config: DeepseekV3Config, max_positions: int, mtp: bool, experts: range, kit: LayerKit
) -> DeepseekV3CausalLM:
    """The decoder, head (+ MTP layer) with this rank's routed experts."""
    return DeepseekV3CausalLM(config, max_positions, with_mtp=mtp, experts=experts, kit=kit)


class V3Placement:
    """The checkpoint's MTP layer as `mtp.*`, and of the routed experts this rank's share."""

    def __init__(self, config: DeepseekV3Config, experts: range, mtp: bool) -> None:
        self.config, self.experts, self.mtp = config, experts, mtp

    def keep(self, key: str) -> bool:
        """Tensors the model has a place for; of the routed experts, this rank's."""
        expert = expert_of(key)
        name = checkpoint_name(key, self.config)
        return name is not None and (expert is None or expert in self.experts)

    def name(self, key: str) -> str | None:
        """The model's name (`checkpoint_name`)."""
        return checkpoint_name(key, self.config)

    def finish(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An MTP layer without a head of its own shares the main model's."""
        if self.mtp and "mtp.shared_head.head.weight" not in state and "lm_head.weight" in state:
            state["mtp.shared_head.head.weight"] = state["lm_head.weight"]
        return state


FAMILY = Family(
    name="deepseek_v3",
    architectures=(ARCHITECTURE,),
    model_types=(MODEL_TYPE,),
    read_config=DeepseekV3Config.from_dir,
    build=build,
    placement=V3Placement,
    num_experts=lambda config: config.n_routed_experts,
)
