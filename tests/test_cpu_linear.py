"""bfloat16 linear layers on packed oneDNN weights (npu_worker/kernels/cpu/layers.py): the
same bits as unpacked ones at every row count, a gated MLP's activation and product fused
into them where that keeps a row's bits whatever its row count, and a row's logits still
do not depend on what shares its launch; float32 layers are left as they are."""

from __future__ import annotations

import random

import pytest
import torch

from npu_worker.kernels.cpu.layers import CpuKit, PackedGated, PackedLinear, PackedProjections
from npu_worker.kernels.cpu.library import has_kernel_linear, load_cpu_kernels
from npu_worker.kernels.cpu.products import gated_fusion_safe, packing_available
from npu_worker.models.llama.model import Attention
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import LoadedModel, load_model
from npu_worker.weights.presets import resolve_model_dir
from tests.helpers import random_prompt
from tests.reference import launch_shapes, prefill_logits

# oneDNN's own products: not where torch lacks oneDNN, nor on a CPU its bfloat16 path refuses
# (without AVX-512 BW/VL/DQ or AVX-NE-CONVERT; `NPUPOOL_CPU_ISA=avx2` makes one)
needs_onednn = pytest.mark.skipif(
    not packing_available(), reason="oneDNN does not pack bfloat16 weights here"
)
pytestmark = [
    pytest.mark.fast,
]
MAX_KV_LEN = 320


def tiny(dtype: str, kit: CpuKit | None = None) -> LoadedModel:
    """The tiny model with MTP, its layers from `kit` (by default oneDNN's packed products,
    no kernels)."""
    kit = kit or CpuKit(None, kernel_products=False)
    path = resolve_model_dir("tiny")
    return load_model(path, dtype, torch.device("cpu"), MAX_KV_LEN, mtp=True, kit=kit)


def launches(packed: bool) -> list[torch.Tensor]:
    """Logits of chunked prefills, a B8 decode of four rows, one row alone, and an MTP
    verify and draft, on a fresh cache (the linears packed with `packed`)."""
    loaded = tiny("bfloat16", CpuKit(load_cpu_kernels(), packed_linears=packed))
    shapes = launch_shapes(8, MAX_KV_LEN, 128, 4)
    runner = LaunchRunner(loaded.model, shapes)
    assert ("packed-linears" in runner.backend.name) == packed
    rng = random.Random(5)
    prompts = [random_prompt(rng, n, loaded.config.vocab_size) for n in (9, 60, 140, 3)]
    out = []
    for slot, prompt in enumerate(prompts):
        for start in range(0, len(prompt), 128):
            out.append(prefill_logits(runner, slot, prompt[start : start + 128], start))
    positions = [len(p) for p in prompts]
    out.append(runner.decode([0, 1, 2, 3], [5, 6, 7, 8], positions))
    out.append(runner.decode([2], [9], [positions[2] + 1]))
    for slot, position in zip(range(4), positions):
        runner.set_tail(slot, 5, position + 1, 6)
    verify = runner.verify([0, 1, 2, 3], max(positions) + 2)
    out += [verify.logits, verify.drafts.float()]
    return out


@needs_onednn
def test_packed_bfloat16_linears_give_the_unpacked_bits() -> None:
    """Every packed layer of the model, at every row count a launch passes it."""
    loaded = tiny("bfloat16")
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    plain = {id(m): m.weight.detach().clone() for m in linears}
    fused = {id(layer) for group in projections(loaded) for layer in group.layers}
    assert all(
        isinstance(m, PackedLinear) and (m.packed is not None or id(m) in fused) for m in linears
    )
    generator = torch.Generator().manual_seed(4)
    for module in linears:
        x = torch.randn(128, module.in_features, generator=generator).bfloat16()
        for rows in range(1, 129):
            want = torch.nn.functional.linear(x[:rows], plain[id(module)], module.bias)
            assert torch.equal(module(x[:rows]), want), f"{module} at {rows} rows"


@needs_onednn
def test_packed_launches_agree_with_unpacked_ones() -> None:
    """With the gated product fused into oneDNN's products (rounded once instead of twice),
    packed launches are no longer the unpacked bits, but within bfloat16's rounding."""
    plain = launches(packed=False)
    packed = launches(packed=True)
    for i, (want, got) in enumerate(zip(plain, packed)):
        torch.testing.assert_close(got, want, rtol=0.01, atol=0.1, msg=f"launch {i}")


@needs_onednn
def test_the_fused_gated_product_is_silu_times_up_and_keeps_a_rows_bits() -> None:
    loaded = tiny("bfloat16")
    mlp = loaded.model.model.layers[0].mlp
    assert isinstance(mlp.gated, PackedGated)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(128, mlp.gate_proj.in_features, generator=generator).bfloat16()
    shape = (mlp.gate_proj.in_features, mlp.gate_proj.out_features, 128)
    if not gated_fusion_safe(*shape):  # this machine's oneDNN sums some row count apart
        assert mlp.gated.post_ops is None
        return
    assert mlp.gated.post_ops is not None
    fused = mlp.gated(x)
    gate, up = mlp.gate_proj(x).float(), mlp.up_proj(x).float()
    torch.testing.assert_close(
        fused.float(), torch.nn.functional.silu(gate) * up, rtol=0.02, atol=0.02
    )
    plain_invariant = all(
        torch.equal(mlp.gate_proj(x[:rows]), mlp.gate_proj(x)[:rows]) for rows in range(1, 128)
    )
    if plain_invariant:  # then so is the fused form
        for rows in range(1, 128):
            assert torch.equal(mlp.gated(x[:rows]), fused[:rows])
    float32 = tiny("float32").model.model.layers[0].mlp
    assert isinstance(float32.gated, PackedGated) and float32.gated.post_ops is None


@needs_onednn
def test_fused_projections_are_the_layers_products() -> None:
    """q, k and v computed in one packed product: each within rounding of its own layer (the
    same bits where oneDNN sums the wider product alike), the layers keeping their plain
    weights, and no second packed copy."""
    unpacked = tiny("bfloat16", CpuKit(None, packed_linears=False))
    plain = unpacked.model.model.layers[0].self_attn
    x = torch.randn(2, 8, plain.q_proj.in_features).bfloat16()
    want = [layer(x).float() for layer in (plain.q_proj, plain.k_proj, plain.v_proj)]
    attention = tiny("bfloat16").model.model.layers[0].self_attn
    assert isinstance(attention.qkv, PackedProjections) and attention.qkv.packed is not None
    fused = attention.qkv(x)
    assert len(fused) == 3
    for got, expected in zip(fused, want):
        torch.testing.assert_close(got.float(), expected, rtol=0.01, atol=0.02)
    assert attention.q_proj.packed is None
    float32 = tiny("float32").model.model.layers[0].self_attn
    assert isinstance(float32.qkv, PackedProjections) and float32.qkv.packed is None


@pytest.mark.parametrize("kernel_products", [False, True], ids=["onednn", "kernels"])
def test_a_rows_bfloat16_logits_do_not_depend_on_its_launch_with_packed_linears(
    kernel_products: bool,
) -> None:
    """With oneDNN's products and with the CPU kernels' own (tests/test_cpu_matmul.py)."""
    kernels = load_cpu_kernels()
    if kernel_products and (kernels is None or not has_kernel_linear()):
        pytest.skip("the kernels' product needs a C compiler and AVX-512 or AVX2 with FMA")
    if not kernel_products and not packing_available():
        pytest.skip("oneDNN does not pack bfloat16 weights here")
    loaded = tiny("bfloat16", CpuKit(kernels, kernel_products=kernel_products))
    runner = LaunchRunner(loaded.model, launch_shapes(8, MAX_KV_LEN, 128, 4))
    assert "packed-linears" in runner.backend.name
    assert ("kernel-products" in runner.backend.name) == kernel_products
    rng = random.Random(6)
    prompts = [random_prompt(rng, n, loaded.config.vocab_size) for n in (30, 100, 7, 64)]
    for slot, prompt in enumerate(prompts):
        prefill_logits(runner, slot, prompt, 0)
    positions = [len(p) for p in prompts]
    together = runner.decode([0, 1, 2, 3], [5, 6, 7, 8], positions)
    for row in range(4):  # the same token at the same position again: the same K/V written
        alone = runner.decode([row], [5 + row], [positions[row]])
        assert torch.equal(alone[0], together[row]), f"row {row}"


def test_float32_linears_are_not_packed() -> None:
    loaded = tiny("float32")
    linears = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.packed is None for m in linears)
    runner = LaunchRunner(loaded.model, launch_shapes(8, MAX_KV_LEN, 128, 4))
    assert "packed-linears" not in runner.backend.name


def projections(loaded: LoadedModel) -> list[PackedProjections]:
    """The model's linear layers packed as one weight (each attention's q, k and v)."""
    return [
        m.qkv
        for m in loaded.model.modules()
        if isinstance(m, Attention) and isinstance(m.qkv, PackedProjections)
        if m.qkv.packed is not None
    ]
