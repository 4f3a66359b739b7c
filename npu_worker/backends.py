"""How a rank runs its fixed-shape launches on each device.

- `eager`: plain torch calls at the static shapes (CPU, or any device for debugging).
- `cuda-graphs`: every (program, batch, sequence, span) shape captured once as a CUDA graph
  at warm-up and replayed; inputs are copied into the graph's static buffers.
- `npu`: torch_npu, compiled in graph mode through torchair where it is installed.

A launch is the main model (`forward`) or the MTP draft (`draft`, fed the main model's
hidden states). Graph backends read the KV cache by slot ids (a gather), since a captured
graph cannot take a different in-place window on every replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from npu_worker.models.cpu_kernels import load_cpu_kernels
from npu_worker.models.cpu_linear import pack_linears
from npu_worker.models.launch import KVCache, LaunchInputs, LaunchModel, LaunchOutput
from npu_worker.models.layers import CPU_KERNELS


class LaunchBackend(Protocol):
    """Runs launches at declared shapes."""

    name: str
    reads_in_place: bool
    packs: bool  # runs packed prefill launches (several requests' segments in one)

    def run(self, launch: LaunchInputs) -> LaunchOutput: ...

    def draft(self, launch: LaunchInputs, hidden: torch.Tensor) -> torch.Tensor: ...


class EagerBackend:
    """Plain torch at static shapes; on the CPU, decode attention through the decode kernel
    where it builds (`decode_kernel`), so each row reads only its own keys, and bfloat16
    linear layers on weights packed once for oneDNN (the same bits, cpu_linear.py)."""

    name = "eager"
    reads_in_place = True
    packs = True

    def __init__(
        self,
        model: LaunchModel,
        cache: KVCache,
        decode_kernel: bool = False,
        packed_linears: bool = True,
        max_rows: int = 128,
    ) -> None:
        self.model, self.cache = model, cache
        if cache.device.type != "cpu":
            return
        if decode_kernel:
            cache.decode_kernel = load_cpu_kernels()
            if cache.decode_kernel is not None:
                self.name += "+decode-kernel"
        if packed_linears:
            pack_linears(model, max_rows, cache.decode_kernel)
        modules = list(model.modules())
        if any(getattr(m, "packed_weight", None) is not None for m in modules):
            self.name += "+packed-linears"
        if any(getattr(m, "packed_by", None) is not None for m in modules):
            self.name += "+kernel-products"

    def run(self, launch: LaunchInputs) -> LaunchOutput:
        token = CPU_KERNELS.set(self.cache.decode_kernel)
        try:
            return self.model(launch, self.cache)
        finally:
            CPU_KERNELS.reset(token)

    def draft(self, launch: LaunchInputs, hidden: torch.Tensor) -> torch.Tensor:
        token = CPU_KERNELS.set(self.cache.decode_kernel)
        try:
            return self.model.draft(launch, hidden, self.cache)
        finally:
            CPU_KERNELS.reset(token)


class CudaGraphBackend:
    """Each launch shape captured once as a CUDA graph; replays copy inputs in place."""

    name = "cuda-graphs"
    reads_in_place = False
    packs = True

    def __init__(self, model: LaunchModel, cache: KVCache) -> None:
        self.model, self.cache = model, cache
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
            positions=torch.full_like(launch.positions, self.cache.scratch_position),
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
            (lambda: self.model(static, self.cache))
            if program == "forward"
            else (lambda: self.model.draft(static, static_hidden, self.cache))  # type: ignore[arg-type]
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

    def __init__(self, model: LaunchModel, cache: KVCache) -> None:
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                "the npu backend needs torch_npu: pip install 'npu-pool[npu]'"
            ) from exc
        self.model, self.cache = model, cache
        self.name = "npu-eager"
        self.forward: Callable[..., Any] = model.forward
        self.draft_forward: Callable[..., Any] = model.draft
        try:
            import torchair

            backend = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
            self.forward = torch.compile(model.forward, backend=backend, dynamic=False)
            self.draft_forward = torch.compile(model.draft, backend=backend, dynamic=False)
            self.name = "npu-graph"
        except ImportError:
            pass

    def run(self, launch: LaunchInputs) -> LaunchOutput:
        return self.forward(launch, self.cache)

    def draft(self, launch: LaunchInputs, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft_forward(launch, hidden, self.cache)


def make_backend(
    model: LaunchModel,
    cache: KVCache,
    device: torch.device,
    cuda_graphs: bool = True,
    decode_kernel: bool = True,
    packed_linears: bool = True,
    max_rows: int = 128,
) -> LaunchBackend:
    """The backend for a device: graphs on CUDA (unless disabled), torch_npu on NPU, else
    eager (on the CPU with the decode kernel, unless disabled)."""
    if device.type == "cuda" and cuda_graphs:
        return CudaGraphBackend(model, cache)
    if device.type == "npu":
        return NpuBackend(model, cache)
    return EagerBackend(model, cache, decode_kernel, packed_linears, max_rows)
