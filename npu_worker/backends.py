"""How a rank runs its fixed-shape launches on each device.

- `eager`: plain torch calls at the static shapes (CPU, or any device for debugging).
- `cuda-graphs`: every (batch, sequence, span) shape captured once as a CUDA graph at
  warm-up and replayed; inputs are copied into the graph's static buffers.
- `npu`: torch_npu, compiled in graph mode through torchair where it is installed.

Graph backends read the KV cache by slot ids (a gather), since a captured graph cannot
take a different in-place window on every replay.
"""

from __future__ import annotations

from typing import Protocol

import torch

from npu_worker.model import CausalLM, KVCache, LaunchInputs


class LaunchBackend(Protocol):
    """Runs one launch at a declared shape and returns its [B, vocab] logits."""

    name: str
    reads_in_place: bool

    def run(self, launch: LaunchInputs) -> torch.Tensor: ...


class EagerBackend:
    """Plain torch at static shapes."""

    name = "eager"
    reads_in_place = True

    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        self.model, self.cache = model, cache

    def run(self, launch: LaunchInputs) -> torch.Tensor:
        return self.model(launch, self.cache)


class CudaGraphBackend:
    """Each launch shape captured once as a CUDA graph; replays copy inputs in place."""

    name = "cuda-graphs"
    reads_in_place = False

    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        self.graphs: dict[
            tuple[int, int, int], tuple[torch.cuda.CUDAGraph, LaunchInputs, torch.Tensor]
        ] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, launch: LaunchInputs) -> torch.Tensor:
        batch, seq = launch.input_ids.shape
        key = (batch, seq, launch.span)
        if key not in self.graphs:
            self.graphs[key] = self._capture(launch)
        graph, static, output = self.graphs[key]
        static.input_ids.copy_(launch.input_ids)
        static.positions.copy_(launch.positions)
        static.slot_ids.copy_(launch.slot_ids)
        static.logit_index.copy_(launch.logit_index)
        graph.replay()
        return output.clone()

    def _capture(
        self, launch: LaunchInputs
    ) -> tuple[torch.cuda.CUDAGraph, LaunchInputs, torch.Tensor]:
        scratch = self.cache.scratch_position
        static = LaunchInputs(
            input_ids=torch.zeros_like(launch.input_ids),
            positions=torch.full_like(launch.positions, scratch),  # warm-up touches scratch
            slot_ids=torch.zeros_like(launch.slot_ids),
            logit_index=torch.zeros_like(launch.logit_index),
            span=launch.span,
            window_start=None,
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(static, self.cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.model(static, self.cache)
        return graph, static, output


class NpuBackend:
    """torch_npu; graph mode through torchair when it is installed, else eager on the NPU."""

    reads_in_place = False

    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                "the npu backend needs torch_npu: pip install 'npu-pool[npu]'"
            ) from exc
        self.model, self.cache = model, cache
        self.name = "npu-eager"
        self.forward = model.forward
        try:
            import torchair

            config = torchair.CompilerConfig()
            backend = torchair.get_npu_backend(compiler_config=config)
            self.forward = torch.compile(model.forward, backend=backend, dynamic=False)
            self.name = "npu-graph"
        except ImportError:
            pass

    def run(self, launch: LaunchInputs) -> torch.Tensor:
        return self.forward(launch, self.cache)


def make_backend(
    model: CausalLM, cache: KVCache, device: torch.device, cuda_graphs: bool = True
) -> LaunchBackend:
    """The backend for a device: graphs on CUDA (unless disabled), torch_npu on NPU."""
    if device.type == "cuda" and cuda_graphs:
        return CudaGraphBackend(model, cache)
    if device.type == "npu":
        return NpuBackend(model, cache)
    return EagerBackend(model, cache)
