"""How a rank runs its fixed-shape launches on each device.

- `eager`: plain torch calls at the static shapes (CPU, or any device for debugging).
- `cuda-graphs`: every (program, batch, sequence, span) shape captured once as a CUDA graph
  at warm-up and replayed; inputs are copied into the graph's static buffers.
- `npu`: torch_npu, compiled in graph mode through torchair where it is installed.

A model whose launches have no one shape (routed experts, models/moe.py: `static_shapes`
False) runs eagerly on every device.

A launch is the main model (`forward`) or the MTP draft (`draft`, fed the main model's
hidden states). Graph backends read the KV cache by slot ids (a gather), since a captured
graph cannot take a different in-place window on every replay. What a model's layers
compute with (on the CPU, its kernels and packed products) was chosen when it was built
(npu_worker/kernels/); a backend only runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from npu_worker.models.launch import LaunchInputs, LaunchModel, LaunchOutput, ModelState


class LaunchBackend(Protocol):
    """Runs launches at declared shapes."""

    name: str
    reads_in_place: bool
    packs: bool  # runs packed prefill launches (several requests' segments in one)

    def run(self, launch: LaunchInputs) -> LaunchOutput: ...

    def draft(self, launch: LaunchInputs, hidden: torch.Tensor) -> torch.Tensor: ...


class EagerBackend:
    """Plain calls at static shapes; its name says what the model's layer kit computes its
    own way (on the CPU: `+decode-kernel`, `+packed-linears`, `+kernel-products`)."""

    reads_in_place = True
    packs = True

    def __init__(self, model: LaunchModel[Any], state: ModelState) -> None:
        self.model, self.state = model, state
        self.name = "eager" + model.kit.name

    def run(self, launch: LaunchInputs) -> LaunchOutput:
        return self.model(launch, self.state)

    def draft(self, launch: LaunchInputs, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.draft(launch, hidden, self.state)


class CudaGraphBackend:
    """Each launch shape captured once as a CUDA graph; replays copy inputs in place."""

    name = "cuda-graphs"
    reads_in_place = False
    packs = True

    def __init__(self, model: LaunchModel[Any], state: ModelState) -> None:
        self.model, self.state = model, state
        self.graphs: dict[
            tuple[Any, ...], tuple[torch.cuda.CUDAGraph, LaunchInputs, torch.Tensor | None, Any]
        ] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, launch: LaunchInputs) -> LaunchOutput:
        out = self._replay("forward", launch, None)
        return LaunchOutput(out.logits.clone(), out.hidden.clone())

    def draft(self, launch: LaunchInputs, hidden: torch.Tensor) -> torch.Tensor:
        return self._replay("draft", launch, hidden).clone()

    def _replay(self, program: str, launch: LaunchInputs, hidden: torch.Tensor | None) -> Any:
        segments = 0 if launch.segment_slots is None else len(launch.segment_slots)
        key = (
            program,
            *launch.input_ids.shape,
            launch.logit_index.shape[1],
            launch.span,
            segments,
        )
        if key not in self.graphs:
            self.graphs[key] = self._capture(program, launch, hidden)
        graph, static, static_hidden, output = self.graphs[key]
        static.input_ids.copy_(launch.input_ids)
        static.positions.copy_(launch.positions)
        static.slot_ids.copy_(launch.slot_ids)
        static.logit_index.copy_(launch.logit_index)
        if static.segment_slots is not None and launch.segment_slots is not None:
            static.segment_slots.copy_(launch.segment_slots)
        if static.token_segments is not None and launch.token_segments is not None:
            static.token_segments.copy_(launch.token_segments)
        if static_hidden is not None and hidden is not None:
            static_hidden.copy_(hidden)
        graph.replay()
        return output

    def _capture(
        self, program: str, launch: LaunchInputs, hidden: torch.Tensor | None
    ) -> tuple[torch.cuda.CUDAGraph, LaunchInputs, torch.Tensor | None, Any]:
        static = LaunchInputs(
            input_ids=torch.zeros_like(launch.input_ids),
            positions=torch.full_like(launch.positions, self.state.scratch_position),
            slot_ids=torch.zeros_like(launch.slot_ids),
            logit_index=torch.zeros_like(launch.logit_index),
            span=launch.span,
            window_start=None,
            segment_slots=None
            if launch.segment_slots is None
            else torch.zeros_like(launch.segment_slots),
            token_segments=None
            if launch.token_segments is None
            else torch.zeros_like(launch.token_segments),
        )
        static_hidden = torch.zeros_like(hidden) if hidden is not None else None
        call: Callable[[], Any] = (
            (lambda: self.model(static, self.state))
            if program == "forward"
            else (lambda: self.model.draft(static, static_hidden, self.state))  # type: ignore[arg-type]
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up writes only the scratch position
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = call()
        return graph, static, static_hidden, output


class NpuBackend:
    """torch_npu; graph mode through torchair when it is installed, else eager on the NPU."""

    reads_in_place = False
    packs = False  # a compiled B1S128 kernel takes one request per call

    def __init__(self, model: LaunchModel[Any], state: ModelState, compiled: bool = True) -> None:
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                "the npu backend needs torch_npu: pip install 'npu-pool[npu]'"
            ) from exc
        self.model, self.state = model, state
        self.name = "npu-eager"
        self.forward: Callable[..., Any] = model.forward
        self.draft_forward: Callable[..., Any] = model.draft
        if not compiled:  # a model whose launches have no one shape runs eagerly
            return
        try:
            import torchair

            backend = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
            self.forward = torch.compile(model.forward, backend=backend, dynamic=False)
            self.draft_forward = torch.compile(model.draft, backend=backend, dynamic=False)
            self.name = "npu-graph"
        except ImportError:
            pass

    def run(self, launch: LaunchInputs) -> LaunchOutput:
        return self.forward(launch, self.state)

    def draft(self, launch: LaunchInputs, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft_forward(launch, hidden, self.state)


def make_backend(
    model: LaunchModel[Any], state: ModelState, device: torch.device, cuda_graphs: bool = True
) -> LaunchBackend:
    """The backend for a device: graphs on CUDA (unless disabled), torch_npu on NPU, else
    eager."""
    static = getattr(model, "static_shapes", True)  # routed experts: shapes follow routing
    if device.type == "cuda" and cuda_graphs and static:
        return CudaGraphBackend(model, state)
    if device.type == "npu":
        return NpuBackend(model, state, compiled=static)
    return EagerBackend(model, state)
