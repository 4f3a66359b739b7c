"""bfloat16 linear layers through the CPU kernels' own product (matmul.c), which the
pool uses where it beats oneDNN's: each output the exact products of its row summed in one
fixed order and rounded once, so a row's bits do not depend on how many rows share the
call, and a prompt's prefill logits are those of decoding it token by token (a row's logits
not depending on what shares its launch: tests/test_cpu_linear.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from npu_worker.kernels.cpu.layers import CpuKit
from npu_worker.kernels.cpu.library import CpuKernels, has_kernel_linear, load_cpu_kernels
from npu_worker.kernels.cpu.products import kernel_products_win, packing_available
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


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    built = load_cpu_kernels()
    if built is None:
        pytest.skip("no C compiler on this machine")
    return built


def float64_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize(
    ("outputs", "inputs", "with_bias"),
    [(96, 64, False), (50, 33, True), (1, 7, False), (200, 130, True)],
)
def test_a_rows_product_is_its_exact_sum_rounded_whatever_the_row_count(
    kernels: CpuKernels, outputs: int, inputs: int, with_bias: bool
) -> None:
    """Odd widths (outputs past a block of 16, an odd number of inputs) included."""
    generator = torch.Generator().manual_seed(outputs)
    weight = torch.randn(outputs, inputs, generator=generator).bfloat16()
    bias = torch.randn(outputs, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(40, inputs, generator=generator).bfloat16()
    packed = kernels.pack_linear(weight)
    every_row = kernels.linear(x, packed, outputs, bias)
    exact = float64_product(x, weight, bias)
    # float32 sums of exact products: within bfloat16's rounding of the exact sum
    tolerance = exact.abs() * 2**-8 + inputs * 2**-20 * (x.double().abs().max() * 4)
    assert ((every_row.double() - exact).abs() <= tolerance).all()
    for rows in range(1, 41):
        alone = kernels.linear(x[:rows].clone(), packed, outputs, bias)
        assert torch.equal(alone, every_row[:rows]), f"{rows} rows"


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


def test_prefill_logits_are_token_by_token_decodes_with_the_kernels_products(
    kernels: CpuKernels,
) -> None:
    """One product for every row count: a prompt prefilled in one chunk gives the bits of
    decoding it one token at a time."""
    loaded = tiny("bfloat16", CpuKit(kernels, kernel_products=True))
    runner = LaunchRunner(loaded.model, launch_shapes(8, MAX_KV_LEN, 128, 4))
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
    for own in (False, True):
        loaded = tiny("bfloat16", CpuKit(kernels, kernel_products=own))
        runner = LaunchRunner(loaded.model, launch_shapes(8, MAX_KV_LEN, 128, 4))
        prompt = random_prompt(rng, 50, loaded.config.vocab_size)
        rng.seed(2)
        logits.append(prefill_logits(runner, 0, prompt, 0).float())
    torch.testing.assert_close(logits[1], logits[0], rtol=0.02, atol=0.15)


def test_the_probes_choice_is_recorded_once_beside_the_library(kernels: CpuKernels) -> None:
    choice = kernel_products_win(kernels)
    if not packing_available():  # the kernels' product is the only one: no probe to record
        assert choice
        return
    record = kernels.path.with_suffix(".products")
    assert record.read_text() in ("kernels", "onednn")
    assert kernel_products_win(kernels) == choice == (record.read_text() == "kernels")
