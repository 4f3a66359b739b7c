"""Quantized checkpoints stay in memory as they are stored (docs/architecture.md §8): FP8 blocks
(DeepSeek-V3's `weight_scale_inv` and V4's release `X.scale`), MXFP4 routed experts (V4's
release) and W8A8 int8 (compressed-tensors). Each loads with its weights in their stored
dtypes, resident bytes within 1.1x of the checkpoint's; FP8 and MXFP4 give the logits and
tokens of a copy of the checkpoint dequantized to float32 (in bfloat16, those of the copy run
on the same products, bit for bit where the kernels read them); MXFP4 dequantizes as the format
defines it, decoded here value by value; W8A8 gives the tokens of a reference that quantizes
activations the same way and sums in float64; a V4 release with FP4 experts serves through
two expert-parallel ranks with each request's lone tokens; formats it cannot read fail at
start naming what they are."""

from __future__ import annotations

import itertools
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from npu_worker.kernels import kit_for
from npu_worker.kernels.cpu import products as cpu_products
from npu_worker.kernels.cpu.layers import (
    CpuKit,
    KernelFp8,
    KernelMxfp4,
    KernelPacked,
    PackedLinear,
)
from npu_worker.kernels.cpu.library import has_kernel_linear, load_cpu_kernels
from npu_worker.kernels.cpu.products import KernelProduct
from npu_worker.models.config import UnsupportedModel
from npu_worker.models.deepseek_v3.model import LatentAttention
from npu_worker.models.stored import Fp8Blocks, Int8Channels, Mxfp4, StoredLinear, int_sums
from npu_worker.runner import LaunchRunner
from npu_worker.weights.checkpoint import read_weights
from npu_worker.weights.loader import LoadedModel, load_model
from npu_worker.weights.tiny import ensure_tiny_model
from producer.client import Client
from tests.conftest import StartPool
from tests.helpers import TIE_TOLERANCE, check_stream, random_prompt
from tests.reference import (
    ReferenceCompletion,
    first_divergence,
    generate_alone,
    launch_shapes,
    lone_runs,
    prefill_logits,
)

v3 = pytest.importorskip("npu_worker.weights.makers.deepseek_v3")
v4 = pytest.importorskip("npu_worker.weights.makers.deepseek_v4")
w8a8 = pytest.importorskip("npu_worker.weights.makers.w8a8")

MAX_MODEL_LEN = 512
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One thread here: a pool's ranks hold the other cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """FP8 V3 (`weight_scale_inv`) and V4's release with FP8 attention and MXFP4 experts."""
    root = tmp_path_factory.mktemp("stored")
    made = {"v3-fp8": root / "v3-fp8", "v4-fp4": root / "v4-fp4"}
    v3.build(made["v3-fp8"], q_lora=True, fp8=True)
    v4.build(made["v4-fp4"], "small", release=True, fp8=True, fp4_experts=True)
    return made


def dequantized_copy(path: Path, out: Path) -> Path:
    """`path` with every quantized weight written as float32 (its stored form widened) and
    no quantization config: what loading used to make of it."""
    read = read_weights(path)
    state = {**read, **{name: stored.dequantize() for name, stored in read.quantized.items()}}
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    config.pop("expert_dtype", None)
    (out / "config.json").write_text(json.dumps(config))
    return out


def stored_layers(loaded: LoadedModel) -> dict[str, StoredLinear]:
    return {
        name: module
        for name, module in loaded.model.named_modules()
        if isinstance(module, StoredLinear) and module.stored is not None
    }


def kernels_read_stored(loaded: LoadedModel) -> bool:
    """Whether a bfloat16 model's products are all the kernels': its weights packed for
    their bfloat16 product, FP8 and MXFP4 ones laid out for theirs (none widened)."""
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    products = {type(layer.product) for layer in layers if layer.product is not None}
    widened = [layer for layer in layers if isinstance(layer.stored, (Fp8Blocks, Mxfp4))]
    return products == {KernelProduct} and not widened


def same_products_kit(stored: LoadedModel) -> CpuKit:
    """A kit whose products for a dequantized copy are those `stored` runs (a bfloat16
    model holding quantized weights): the kernels' own where they read its stored weights
    (a plain bfloat16 model may get oneDNN's there, from the probe, whose sums are others:
    its gated form takes silu and the product on the float32 sums, rounded once); else
    torch's plain products, which its widened weights go through."""
    library = load_cpu_kernels()
    if kernels_read_stored(stored):
        return CpuKit(library, kernel_products=True)
    return CpuKit(library, packed_linears=False)


def runs_alone(loaded: LoadedModel, prompts: list[list[int]]) -> list[ReferenceCompletion]:
    """Each prompt run alone on one runner of `loaded`, 12 tokens, EOS ignored."""
    runner = LaunchRunner(loaded.model, launch_shapes(1, MAX_MODEL_LEN, 128, 1))
    return [generate_alone(runner, prompt, 12, set(), MAX_MODEL_LEN) for prompt in prompts]


def prompts_for(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, n, vocab_size) for n in (7, 60, 150)]


def first_logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    runner = LaunchRunner(loaded.model, launch_shapes(1, MAX_MODEL_LEN, 128, 1))
    chunk = runner.prefill_chunk
    logits = torch.empty(0)
    for start in range(0, len(prompt), chunk):
        logits = prefill_logits(runner, 0, prompt[start : start + chunk], start)
    return logits


@pytest.mark.parametrize(
    ("name", "form", "count"), [("v3-fp8", Fp8Blocks, 8), ("v4-fp4", Mxfp4, 16)]
)
def test_quantized_weights_stay_stored_and_give_the_tokens_of_their_dequantized_copy(
    name: str, form: type, count: int, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints[name]
    loaded = load_model(path, "float32", CPU, MAX_MODEL_LEN)
    layers = stored_layers(loaded)
    kinds = [type(layer.stored) for layer in layers.values()]
    assert kinds.count(form) >= count, kinds
    for layer in layers.values():
        assert layer.stored is not None
        assert set(dict(layer.named_buffers())) == {f"stored_{k}" for k in layer.stored.tensors()}
        assert all(
            t.dtype in (torch.float8_e4m3fn, torch.uint8, torch.float32)
            for t in layer.stored.tensors().values()
        )
        assert "weight" not in dict(layer.named_parameters())
    # MLA's absorbed kv_b_proj is the one weight widened at load (read transposed per head,
    # ~0.3% of V3's bytes at its published size, a larger share of this tiny one's)
    absorbed = [m for m in loaded.model.modules() if isinstance(m, LatentAttention)]
    for attention in absorbed:
        assert attention.absorbed is not None
        assert torch.equal(attention.absorbed, attention.kv_b_proj.weight)  # same bits
    widened_once = sum(
        a.absorbed.numel() * a.absorbed.element_size() for a in absorbed if a.absorbed is not None
    )
    assert loaded.weight_bytes <= 1.1 * loaded.checkpoint_bytes + widened_once, (
        loaded.weight_bytes,
        loaded.checkpoint_bytes,
        widened_once,
    )
    in_bf16 = load_model(path, "bfloat16", CPU, MAX_MODEL_LEN)  # laid out for the CPU's kit
    for layer in stored_layers(in_bf16).values():  # holding one form's tensors, no more
        assert layer.stored is not None
        held = {f"stored_{k}" for k in layer.stored.tensors()}
        assert set(dict(layer.named_buffers())) == held
    copy = dequantized_copy(path, tmp_path / "copy")
    widened = load_model(copy, "float32", CPU, MAX_MODEL_LEN)
    assert widened.weight_bytes > 2 * loaded.weight_bytes or name == "v3-fp8"
    vocab = loaded.config.vocab_size
    prompts = prompts_for(vocab, 35)
    for prompt in prompts:  # the same weights, the same products: the same bits
        assert torch.equal(first_logits(loaded, prompt), first_logits(widened, prompt))
    stored_runs = lone_runs(path, "float32", prompts, 12, MAX_MODEL_LEN)
    copy_runs = lone_runs(copy, "float32", prompts, 12, MAX_MODEL_LEN)
    for got, want in zip(stored_runs, copy_runs, strict=True):
        assert got.token_ids == want.token_ids
    # in bfloat16, the copy run on the products the stored model runs
    copy_in_bf16 = load_model(copy, "bfloat16", CPU, MAX_MODEL_LEN, kit=same_products_kit(in_bf16))
    bf16_runs = zip(runs_alone(in_bf16, prompts), runs_alone(copy_in_bf16, prompts), strict=True)
    if kernels_read_stored(in_bf16):
        # the kernels' FP8 and MXFP4 products have their bfloat16 product's bits
        assert kernels_read_stored(copy_in_bf16)
        for prompt in prompts:
            got, want = first_logits(in_bf16, prompt), first_logits(copy_in_bf16, prompt)
            assert torch.equal(got, want)
        for got, want in bf16_runs:
            assert got.token_ids == want.token_ids
    else:  # torch's products over weights widened at each call; a packed head may differ
        for got, want in bf16_runs:
            assert first_divergence(got.token_ids, want, TIE_TOLERANCE) is None


def test_mxfp4_weights_dequantize_as_the_format_defines_them(
    checkpoints: dict[str, Path],
) -> None:
    """Each byte two e2m1 values (even input low), sign bit 3, exponent bits 1-2, mantissa
    bit 0; each 32 inputs times 2^(scale byte - 127): decoded value by value here."""
    stored = load_file(str(checkpoints["v4-fp4"] / "model.safetensors"))
    experts = [k for k in stored if ".ffn.experts." in k and k.endswith(".weight")]
    assert experts and all(stored[k].dtype == torch.float4_e2m1fn_x2 for k in experts)
    name = experts[0]
    packed = stored[name].view(torch.uint8)
    scale = stored[name.removesuffix(".weight") + ".scale"]
    assert scale.dtype == torch.float8_e8m0fnu
    rows, cols = packed.shape[0], packed.shape[1] * 2
    want = torch.empty(rows, cols)
    scales = scale.view(torch.uint8).tolist()
    for r, row in enumerate(packed.tolist()):
        for c in range(cols):
            nibble = (row[c // 2] >> (4 * (c % 2))) & 0xF
            sign = -1.0 if nibble & 8 else 1.0
            exponent, mantissa = (nibble >> 1) & 3, nibble & 1
            magnitude = (
                mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
            )
            want[r, c] = sign * magnitude * 2.0 ** (scales[r][c // 32] - 127)
    got = Mxfp4(packed, scale.view(torch.uint8)).dequantize()
    assert torch.equal(got, want)
    assert want.abs().max() > 0


def w8a8_reference(loaded: LoadedModel) -> None:
    """Every W8A8 layer of `loaded` computed another way: activations quantized per token
    as the format says, the integer products summed in float64, then scaled."""

    def forward(layer: StoredLinear, x: torch.Tensor) -> torch.Tensor:
        stored = layer.stored
        assert isinstance(stored, Int8Channels)
        rows = x.reshape(-1, x.shape[-1]).float()
        scale = rows.abs().amax(dim=-1, keepdim=True) / 127.0
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(rows / scale).clamp(-128, 127)
        sums = (q.double() @ stored.weight.double().t()).float()
        out = sums * scale * stored.scale.float()
        return out.to(x.dtype).view(*x.shape[:-1], -1)

    for layer in stored_layers(loaded).values():
        layer.forward = forward.__get__(layer)  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def w8a8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama as W8A8 alone (the fast tier's, and each instruction set's in CI)."""
    path = tmp_path_factory.mktemp("stored") / "w8a8"
    w8a8.quantize(ensure_tiny_model(), path)
    return path


@pytest.mark.fast
def test_int8_sums_are_exact_where_pairs_of_byte_products_overflow_int16() -> None:
    """The W8A8 product's integer sums, on whatever product this CPU (or its
    `NPUPOOL_CPU_ISA`) gives: oneDNN's where it is exact, else float32 parts of at most
    1,024 inputs; the widest products (127 * 127 in pairs, -128 * -127) and more inputs
    than one part holds, against int64 sums."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (5, 2500), generator=generator, dtype=torch.int8)
    weight = torch.randint(-127, 128, (40, 2500), generator=generator, dtype=torch.int8)
    q[0], weight[0] = 127, 127
    q[1], weight[1] = -128, -127
    want = q.long() @ weight.long().t()
    got = int_sums(q, weight)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert want.abs().max() > 2**24  # beyond float32's exact integers in one sum
    for rows in (1, 3):  # a row's sums are its own
        assert torch.equal(int_sums(q[:rows].contiguous(), weight), got[:rows])


@pytest.mark.fast
def test_w8a8_weights_stay_int8_and_give_the_tokens_of_a_float64_reference(
    w8a8_checkpoint: Path,
) -> None:
    path = w8a8_checkpoint
    loaded = load_model(path, "float32", CPU, MAX_MODEL_LEN)
    layers = stored_layers(loaded)
    assert len(layers) >= 4 and all(isinstance(x.stored, Int8Channels) for x in layers.values())
    assert all(x.stored.weight.dtype == torch.int8 for x in layers.values())  # type: ignore[union-attr]
    stored = load_file(str(path / "model.safetensors"))
    for name, layer in layers.items():  # each weight resident as its int8 and scales, no more
        held = sum(t.numel() * t.element_size() for t in layer.stored.tensors().values())  # type: ignore[union-attr]
        kept = [stored[f"{name}.weight"], stored[f"{name}.weight_scale"]]
        assert held == sum(t.numel() * t.element_size() for t in kept), name
    # the model in bfloat16 (its floats' checkpoint dtype here is float32, its rotary tables a
    # large part of so small a model): within 1.1x of the checkpoint
    in_bf16 = load_model(path, "bfloat16", CPU, MAX_MODEL_LEN)
    assert in_bf16.weight_bytes <= 1.1 * in_bf16.checkpoint_bytes
    reference = load_model(path, "float32", CPU, MAX_MODEL_LEN)
    w8a8_reference(reference)
    prompts = prompts_for(loaded.config.vocab_size, 36)
    shapes = launch_shapes(1, MAX_MODEL_LEN, 128, 1)
    for model in (loaded, reference):
        model.model.eval()
    got = [
        generate_alone(LaunchRunner(loaded.model, shapes), p, 12, set(), MAX_MODEL_LEN)
        for p in prompts
    ]
    want = [
        generate_alone(LaunchRunner(reference.model, shapes), p, 12, set(), MAX_MODEL_LEN)
        for p in prompts
    ]
    for a, b in zip(got, want, strict=True):
        assert first_divergence(a.token_ids, b, TIE_TOLERANCE) is None
    # and the quantization is real: the float weights give other logits
    float_copy = load_model(ensure_tiny_model(), "float32", CPU, MAX_MODEL_LEN)
    assert not torch.equal(first_logits(loaded, prompts[1]), first_logits(float_copy, prompts[1]))


def test_a_v4_release_with_fp4_experts_serves_on_two_expert_parallel_ranks(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client
) -> None:
    path = checkpoints["v4-fp4"]
    start_pool(
        model=str(path),
        ranks=2,
        expert_parallel=True,
        decode_batch=8,
        kv_slots_per_rank=8,
        max_model_len=MAX_MODEL_LEN,
    )
    rng = random.Random(37)
    prompts = [random_prompt(rng, n, v4.VOCAB_SIZE) for n in (5, 40, 140, 9, 70, 200)]
    ids = [client.submit(prompt_token_ids=p, max_tokens=10, ignore_eos=True) for p in prompts]
    references = lone_runs(path, "float32", prompts, 10, MAX_MODEL_LEN)
    for request_id, reference in zip(ids, references, strict=True):
        tokens = check_stream(list(client.stream(request_id, timeout_s=240)))
        assert first_divergence(tokens, reference, TIE_TOLERANCE) is None, request_id


def test_the_kernels_mxfp4_product_gives_the_bits_of_the_bfloat16_product_dequantized() -> None:
    """MXFP4 bytes read as stored, widened in registers: the same bits as the kernels'
    bfloat16 product over the dequantized weight, at every row count (so a row alone and
    the same row among others agree), with a bias and with outputs past a block's end."""
    library = load_cpu_kernels()
    if library is None or not library.has_mxfp4:
        pytest.skip("the kernels' MXFP4 product needs AVX2 with FMA, or AVX-512")
    generator = torch.Generator().manual_seed(38)
    for outputs, inputs in ((16, 64), (40, 96), (33, 128)):
        packed = torch.randint(0, 256, (outputs, inputs // 2), generator=generator)
        scales = torch.randint(118, 132, (outputs, inputs // 32), generator=generator)
        stored = Mxfp4(packed.to(torch.uint8), scales.to(torch.uint8))
        kernel = KernelMxfp4.of(stored)
        assert torch.equal(kernel.as_stored().packed, stored.packed)
        assert torch.equal(kernel.as_stored().scale, stored.scale)
        plain = library.pack_linear(stored.dequantize().bfloat16())
        bias = torch.randn(outputs, generator=generator)
        x = torch.randn(37, inputs, generator=generator).bfloat16()
        for rows in (1, 3, 4, 5, 9, 37):
            want = library.linear(x[:rows], plain, outputs, bias)
            got = library.linear_mxfp4(x[:rows], kernel.packed, kernel.scales, outputs, bias)
            assert torch.equal(got, want), (outputs, inputs, rows)


def test_the_kernels_fp8_product_gives_the_bits_of_the_bfloat16_product_dequantized() -> None:
    """e4m3 bytes read as stored (every byte value, NaN and subnormals included), widened
    once a call: the bits of the kernels' bfloat16 product over the dequantized weight
    rounded to bfloat16, at every row count, for square and narrow scale blocks, odd
    inputs and outputs past a block's end, with any scales and with powers of two."""
    library = load_cpu_kernels()
    if library is None or not library.has_fp8:
        pytest.skip("the kernels' FP8 product needs AVX2 with FMA and F16C, or AVX-512")
    generator = torch.Generator().manual_seed(39)
    cases = (((16, 64), (16, 16)), ((40, 300), (128, 128)), ((300, 257), (32, 64)))
    for ((outputs, inputs), block), powers_of_two in itertools.product(cases, (False, True)):
        codes = torch.randint(0, 256, (outputs, inputs), generator=generator).to(torch.uint8)
        codes[(codes & 0x7F) == 0x7F] -= 1  # NaN only in the first output's weights
        codes[0, : min(inputs, 256)] = torch.arange(min(inputs, 256), dtype=torch.uint8)
        grid = (-(-outputs // block[0]), -(-inputs // block[1]))
        scale = torch.rand(grid, generator=generator) * 1e-2 + 1e-3
        if powers_of_two:  # UE8M0 scales, as V4's release writes them (an exact product)
            scale = torch.exp2(torch.randint(-30, 8, grid, generator=generator).float())
        stored = Fp8Blocks(codes.view(torch.float8_e4m3fn), scale, block)
        kernel = KernelFp8.of(stored)
        assert torch.equal(kernel.as_stored().weight.view(torch.uint8), codes)
        assert torch.equal(kernel.as_stored().scale, scale)
        plain = library.pack_linear(stored.dequantize().bfloat16())
        bias = torch.randn(outputs, generator=generator)
        x = torch.randn(37, inputs, generator=generator).bfloat16()
        for rows in (1, 3, 4, 5, 9, 37):
            want = library.linear(x[:rows], plain, outputs, bias)
            got = library.linear_fp8(
                x[:rows], kernel.packed, kernel.scales, block[1], outputs, bias
            )
            assert torch.equal(got.isnan(), want.isnan()), (outputs, inputs, rows)
            assert got[:, 1:].isfinite().all()
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), (outputs, inputs, rows)


def test_a_model_whose_stored_weights_the_kernels_read_runs_their_products_throughout(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the probe picks oneDNN's bfloat16 product, a plain bfloat16 model runs it, but
    one whose FP8 or MXFP4 weights the kernels read as stored packs its other weights for
    the kernels' bfloat16 product: all its products one family, summing as the stored
    ones do."""
    library = load_cpu_kernels()
    if library is None or not (library.has_fp8 and library.has_mxfp4 and has_kernel_linear()):
        pytest.skip("the kernels' FP8, MXFP4 and bfloat16 products do not run here")
    monkeypatch.setattr(cpu_products, "fastest_product", lambda _: "onednn")
    plain = load_model(ensure_tiny_model(), "bfloat16", CPU, MAX_MODEL_LEN, kit=CpuKit(library))
    assert not kernels_read_stored(plain)
    for name in ("v3-fp8", "v4-fp4"):
        stored = load_model(checkpoints[name], "bfloat16", CPU, MAX_MODEL_LEN, kit=CpuKit(library))
        assert kernels_read_stored(stored), name
        layers = [m for m in stored.model.modules() if isinstance(m, PackedLinear)]
        assert any(isinstance(layer.stored, (KernelFp8, KernelMxfp4)) for layer in layers)
    forced = CpuKit(library, kernel_products=False)  # a choice made by hand stays
    stored = load_model(checkpoints["v3-fp8"], "bfloat16", CPU, MAX_MODEL_LEN, kit=forced)
    assert not kernels_read_stored(stored)


def test_a_head_packed_for_the_kernels_product_is_held_once(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """An untied head packed for the kernels' product lets go of its plain weight (reading
    `.weight` unpacks it, bit for bit); a tied one keeps it, since the embedding uses it."""
    path = checkpoints["v4-fp4"]
    loaded = load_model(path, "bfloat16", CPU, MAX_MODEL_LEN, kit=kit_for(CPU))
    head = loaded.model.get_submodule("head")
    assert isinstance(head, PackedLinear)
    if not isinstance(head.product, KernelProduct):
        pytest.skip("the kernels' product does not pack bfloat16 here")
    assert isinstance(head.stored, KernelPacked)
    assert "weight" not in dict(head.named_parameters())
    assert torch.equal(head.weight, read_weights(path)["head.weight"].bfloat16())

    tied = tmp_path / "tied"
    shutil.copytree(ensure_tiny_model(), tied)
    state = load_file(str(tied / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tied / "model.safetensors"))
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    model = load_model(tied, "bfloat16", CPU, MAX_MODEL_LEN, kit=kit_for(CPU)).model
    assert model.get_submodule("lm_head").stored is None
    assert model.get_submodule("lm_head").weight is model.input_embeddings().weight


@pytest.mark.parametrize("kernel_products", [True, False])
def test_every_packed_bfloat16_weight_is_held_once(kernel_products: bool) -> None:
    """Packed for either product, alone or in a group (q, k and v; gate and up), a layer lets
    go of its plain weight: the model holds each weight's bytes once, and `.weight` reads the
    checkpoint's weight bit for bit."""
    library = load_cpu_kernels()
    if kernel_products and (library is None or not has_kernel_linear()):
        pytest.skip("the kernels' product is not built here")
    if not kernel_products and not cpu_products.packing_available():
        pytest.skip("oneDNN does not pack bfloat16 here")
    path = ensure_tiny_model()
    kit = CpuKit(library, kernel_products=kernel_products)
    loaded = load_model(path, "bfloat16", CPU, MAX_MODEL_LEN, kit=kit)
    assert loaded.model.kit.product is not None
    expected = "kernels" if kernel_products else "onednn"
    assert loaded.model.kit.product.name == expected
    checkpoint = read_weights(path)
    layers = {n: m for n, m in loaded.model.named_modules() if isinstance(m, PackedLinear)}
    assert layers
    for name, layer in layers.items():
        assert "weight" not in dict(layer.named_parameters()), name
        assert torch.equal(layer.weight, checkpoint[f"{name}.weight"].bfloat16()), name
    in_bfloat16 = sum(t.numel() * 2 for t in checkpoint.values())
    assert loaded.weight_bytes <= 1.02 * in_bfloat16, (loaded.weight_bytes, in_bfloat16)


def test_formats_it_cannot_read_fail_at_start_naming_them(
    checkpoints: dict[str, Path], w8a8_checkpoint: Path, tmp_path: Path
) -> None:
    fp4 = tmp_path / "fp4-bad-scales"
    shutil.copytree(checkpoints["v4-fp4"], fp4)
    state = load_file(str(fp4 / "model.safetensors"))
    name = next(k for k in state if ".ffn.experts." in k and k.endswith(".scale"))
    state[name] = state[name][:, :1].contiguous()  # one scale a row: not one per 32 inputs
    save_file(state, str(fp4 / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match="weights? .*(scales|stored as)"):
        load_model(fp4, "float32", CPU, MAX_MODEL_LEN)

    int4 = tmp_path / "int4"
    shutil.copytree(w8a8_checkpoint, int4)
    config = json.loads((int4 / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (int4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="num_bits': 4.*W8A8"):
        load_model(int4, "float32", CPU, MAX_MODEL_LEN)

    unknown = tmp_path / "fp6"
    shutil.copytree(checkpoints["v4-fp4"], unknown)
    config = json.loads((unknown / "config.json").read_text())
    config["expert_dtype"] = "fp6"
    (unknown / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="experts stored as 'fp6'"):
        load_model(unknown, "float32", CPU, MAX_MODEL_LEN)
