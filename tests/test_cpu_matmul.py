"""bfloat16 linear layers through the CPU kernels' own products (matmul.c's multiply-adds,
matmul_amx.c's AMX tiles), which the pool uses where one beats oneDNN's: each output the
exact products of its row summed in one fixed order and rounded once, so a row's bits do not
depend on how many rows share the call, and a prompt's prefill logits are those of decoding
it token by token (a row's logits not depending on what shares its launch:
tests/test_cpu_linear.py)."""

from __future__ import annotations

import random
from typing import Any, Literal

import pytest
import torch

from npu_worker.kernels.cpu.layers import CpuKit
from npu_worker.kernels.cpu.library import CpuKernels, has_kernel_linear
from npu_worker.kernels.cpu.products import (
    KernelProduct,
    Product,
    TileProduct,
    fastest_product,
    packing_available,
)
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import LoadedModel, load_model
from npu_worker.weights.presets import resolve_model_dir
from tests.helpers import random_prompt
from tests.reference import launch_shapes, prefill_logits

pytestmark = [
    pytest.mark.fast,
    pytest.mark.skipif(
        not has_kernel_linear(), reason="the kernels' product needs AVX-512 or AVX2 with FMA"
    ),
]
MAX_KV_LEN = 320


def float64_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def own_product(kernels: CpuKernels, name: str) -> Product:
    """The kernels' multiply-adds ("kernels") or tiles ("tiles", skipped where there are
    none)."""
    if name == "tiles":
        if not kernels.has_tiles:
            pytest.skip("no AMX tiles on this CPU, in this build or from this kernel")
        return TileProduct(kernels)
    return KernelProduct(kernels)


@pytest.mark.parametrize("product_name", ["kernels", "tiles"])
@pytest.mark.parametrize(
    ("outputs", "inputs", "with_bias"),
    [(96, 64, False), (50, 33, True), (1, 7, False), (200, 130, True), (40, 160, True)],
)
def test_a_rows_product_is_its_exact_sum_rounded_whatever_the_row_count(
    kernels: CpuKernels, product_name: str, outputs: int, inputs: int, with_bias: bool
) -> None:
    """Odd widths (outputs past a block of 16, an odd number of inputs, inputs the tiles
    do not take whole) included; 1-40 rows: whole tiles of 16 rows, and rows short of one."""
    product = own_product(kernels, product_name)
    generator = torch.Generator().manual_seed(outputs)
    weight = torch.randn(outputs, inputs, generator=generator).bfloat16()
    bias = torch.randn(outputs, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(40, inputs, generator=generator).bfloat16()
    packed = product.pack(weight)
    every_row = product(x, packed, outputs, bias)
    exact = float64_product(x, weight, bias)
    # float32 sums of exact products: within bfloat16's rounding of the exact sum
    tolerance = exact.abs() * 2**-8 + inputs * 2**-20 * (x.double().abs().max() * 4)
    assert ((every_row.double() - exact).abs() <= tolerance).all()
    for rows in range(1, 41):
        alone = product(x[:rows].clone(), packed, outputs, bias)
        assert torch.equal(alone, every_row[:rows]), f"{rows} rows"
    for start in (3, 16, 21):  # rows from elsewhere in a tile, of a strided input
        wide = torch.zeros(40, inputs + 32, dtype=torch.bfloat16)
        wide[:, 16 : 16 + inputs] = x
        got = product(wide[start:, 16 : 16 + inputs], packed, outputs, bias)
        assert torch.equal(got, every_row[start:]), f"from row {start}"


@pytest.mark.parametrize(("inter", "hidden"), [(176, 64), (48, 96), (1536, 576)])
def test_the_tiles_gated_product_is_silu_times_up_and_keeps_a_rows_bits(
    kernels: CpuKernels, inter: int, hidden: int
) -> None:
    """silu(x gate) * (x up) in one call on the tiles: within one rounding of the unfused
    form's every element (the activation is the kernels' own, not torch's), and a row's
    bits at every row count."""
    product = own_product(kernels, "tiles")
    assert isinstance(product, TileProduct)
    generator = torch.Generator().manual_seed(inter)
    weight = (torch.randn(2 * inter, hidden, generator=generator) * 0.1).bfloat16()
    packed = product.pack(weight)
    x = torch.randn(40, hidden, generator=generator).bfloat16()
    fused = product.gated_pair(x, packed, 2 * inter)
    assert fused is not None and fused.shape == (40, inter)
    gate, up = product(x, packed, 2 * inter, None).split([inter, inter], dim=-1)
    unfused = torch.nn.functional.silu(gate) * up
    assert ((fused.float() - unfused.float()).abs() <= unfused.float().abs() * 2**-7).all()
    for rows in range(1, 41):
        assert torch.equal(product.gated_pair(x[:rows].clone(), packed, 2 * inter), fused[:rows])
    assert product.gated_pair(x[:, :33].contiguous(), packed, 2 * inter) is None


def test_the_product_reads_rows_of_a_strided_input(kernels: CpuKernels) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=generator).bfloat16()
    wide = torch.randn(8, 160, generator=generator).bfloat16()
    packed = kernels.pack_linear(weight)
    got = kernels.linear(wide[:, 32:96], packed, 48, None)
    assert torch.equal(got, kernels.linear(wide[:, 32:96].contiguous(), packed, 48, None))


def tiny(dtype: str, kit: CpuKit) -> LoadedModel:
    path = resolve_model_dir("tiny")
    return load_model(path, dtype, torch.device("cpu"), MAX_KV_LEN, mtp=True, kit=kit)


@pytest.mark.parametrize("product_name", ["kernels", "tiles"])
def test_prefill_logits_are_token_by_token_decodes_with_the_kernels_products(
    kernels: CpuKernels, product_name: str
) -> None:
    """One product for every row count: a prompt prefilled in one chunk gives the bits of
    decoding it one token at a time."""
    chosen: Literal["tiles"] | bool = "tiles" if product_name == "tiles" else True
    own_product(kernels, product_name)  # skipped where it does not run
    loaded = tiny("bfloat16", CpuKit(kernels, kernel_products=chosen))
    runner = LaunchRunner(loaded.model, launch_shapes(8, MAX_KV_LEN, 128, 4))
    assert f"{product_name[:-1]}-products" in runner.backend.name
    prompt = random_prompt(random.Random(8), 20, loaded.config.vocab_size)
    whole = prefill_logits(runner, 0, prompt, 0)
    for position, token in enumerate(prompt):
        stepped = runner.decode([1], [token], [position])
    assert torch.equal(stepped[0], whole[0])


def test_the_kernels_products_agree_with_onednns_within_rounding(kernels: CpuKernels) -> None:
    if not packing_available():
        pytest.skip("oneDNN does not pack bfloat16 weights here")
    rng = random.Random(2)
    logits = []
    own: list[bool | Literal["tiles"]] = [False, True] + (["tiles"] if kernels.has_tiles else [])
    for chosen in own:
        loaded = tiny("bfloat16", CpuKit(kernels, kernel_products=chosen))
        runner = LaunchRunner(loaded.model, launch_shapes(8, MAX_KV_LEN, 128, 4))
        prompt = random_prompt(rng, 50, loaded.config.vocab_size)
        rng.seed(2)
        logits.append(prefill_logits(runner, 0, prompt, 0).float())
    for got in logits[1:]:
        torch.testing.assert_close(got, logits[0], rtol=0.02, atol=0.15)


def test_the_probes_choice_is_recorded_once_beside_the_library(kernels: CpuKernels) -> None:
    choice = fastest_product(kernels)
    if not packing_available():  # the kernels' products are the only ones: no probe to record
        assert choice in ("kernels", "tiles")
        return
    record = kernels.path.with_suffix(".products")
    assert record.read_text() in ("kernels", "onednn", "tiles")
    assert fastest_product(kernels) == choice == record.read_text()
    assert choice != "tiles" or kernels.has_tiles
