"""The CPU decode kernel: each row attends over its own slot's keys up to its position, as
masked attention over the span does, and a row's output is bit-identical whatever span the
launch reads and whatever the other rows hold; without a compiler, launches fall back to
batched matrix products."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from npu_worker.devices import auto_dtype, cpu_prefers_bf16
from npu_worker.kernels import kit_for
from npu_worker.kernels.cpu.layers import CpuKit
from npu_worker.kernels.cpu.library import CpuKernels, load_cpu_kernels
from npu_worker.models.launch import LaunchInputs
from npu_worker.models.layers import RMSNorm, attend, causal_mask, rotate_half
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import LoadedModel, load_model
from npu_worker.weights.presets import resolve_model_dir
from schemas.config import Settings
from tests.helpers import load_reference_model, random_prompt
from tests.reference import launch_shapes, prefill_logits

pytestmark = pytest.mark.fast

SLOTS, POSITIONS = 6, 257  # positions + 1: the last is the cache's scratch position
SCRATCH = POSITIONS - 1


@pytest.fixture(scope="module")
def kernel() -> CpuKernels:
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    built = load_cpu_kernels()
    assert built is not None, "the CPU kernels failed to build (see the log)"
    return built


def random_cache(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (SLOTS, kv_heads, POSITIONS, dim)
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    return k, v


def masked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """The batched-matrix path: the rows' slots over the whole span, masked by position."""
    visible = causal_mask(positions, span)
    return attend(q, k[slots, :, :span], v[slots, :, :span], visible, k.shape[1])


@pytest.mark.parametrize("dim", [64, 16])  # 64: the vector path; 16: the portable one
@pytest.mark.parametrize("seq", [1, 2])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (4, 4)])
def test_kernel_matches_masked_attention_over_the_span(
    kernel: CpuKernels, dim: int, seq: int, heads: int, kv_heads: int
) -> None:
    k, v = random_cache(heads, kv_heads, dim, torch.float32, seed=dim + seq + heads)
    q = torch.randn(4, seq, heads, dim, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([3, 0, 5, 1])
    last = torch.tensor([0, 17, 130, 190])  # each row's first query position
    positions = last[:, None] + torch.arange(seq)[None, :]
    ours = kernel(q, k, v, slots, positions, 256, dim**-0.5)
    theirs = masked_reference(q, k, v, slots, positions, 256)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-6)


def test_kernel_reads_bfloat16_caches(kernel: CpuKernels) -> None:
    k, v = random_cache(9, 3, 64, torch.bfloat16, seed=7)
    q = torch.randn(3, 2, 9, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    slots, positions = torch.tensor([2, 4, 1]), torch.tensor([[5, 6], [99, 100], [200, 201]])
    ours = kernel(q, k, v, slots, positions, 224, 64**-0.5)
    assert ours.dtype == torch.bfloat16
    theirs = masked_reference(q.float(), k.float(), v.float(), slots, positions, 224)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-2, atol=1e-2)


def test_padding_rows_see_no_keys_and_get_zeros(kernel: CpuKernels) -> None:
    k, v = random_cache(4, 2, 64, torch.float32, seed=3)
    q = torch.randn(2, 2, 4, 64)
    positions = torch.tensor([[SCRATCH, SCRATCH], [40, SCRATCH]])
    out = kernel(q, k, v, torch.tensor([0, 1]), positions, 64, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1, 1], torch.zeros_like(out[1, 1]))
    assert out[1, 0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 16])
def test_a_rows_output_is_bit_identical_whatever_span_or_neighbours(
    kernel: CpuKernels, dtype: torch.dtype, dim: int
) -> None:
    k, v = random_cache(9, 3, dim, dtype, seed=11)
    generator = torch.Generator().manual_seed(5)
    mine = torch.randn(1, 1, 9, dim, generator=generator).to(dtype)
    alone = kernel(mine, k, v, torch.tensor([4]), torch.tensor([[77]]), 96, dim**-0.5)
    for span, row, batch in [(96, 0, 1), (128, 2, 4), (256, 5, 6), (160, 1, 3)]:
        q = torch.randn(batch, 1, 9, dim, generator=generator).to(dtype)
        q[row] = mine[0]
        slots = torch.randint(0, SLOTS, (batch,), generator=generator)
        slots[row] = 4
        positions = torch.randint(0, span, (batch, 1), generator=generator)
        positions[row] = 77
        out = kernel(q, k, v, slots, positions, span, dim**-0.5)
        assert torch.equal(out[row], alone[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 16])
def test_a_prefill_rows_positions_are_bit_identical_however_many_threads_split_them(
    kernel: CpuKernels, dtype: torch.dtype, dim: int
) -> None:
    """With several threads a prefill row's positions are split into tasks; each query's
    output is its own whatever task computes it, and agrees with masked attention."""
    k, v = random_cache(9, 3, dim, dtype, seed=13)
    generator = torch.Generator().manual_seed(7)
    seq, span = 80, 256
    q = torch.randn(2, seq, 9, dim, generator=generator).to(dtype)
    slots = torch.tensor([3, 1])
    positions = torch.stack([torch.arange(seq) + 100, torch.arange(seq)])
    positions[1, 70:] = SCRATCH  # padding positions see nothing
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3, 8):
            torch.set_num_threads(count)
            outs.append(kernel(q, k, v, slots, positions, span, dim**-0.5))
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    want = masked_reference(q.float(), k.float(), v.float(), slots, positions, span)
    got = outs[0].float()
    assert torch.equal(got[1, 70:], torch.zeros_like(got[1, 70:]))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got[:, :70], want[:, :70].to(dtype).float(), atol=tolerance)


def assert_each_row_as_alone(
    kernel: CpuKernels,
    together: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    span: int,
    tables: torch.Tensor,
) -> None:
    """Each row of a launch's output has the bits the row gets in a launch of its own."""
    slot = torch.zeros(1, dtype=torch.long)
    scale = q.shape[-1] ** -0.5
    for row in range(len(tables)):
        one = slice(row, row + 1)
        alone = kernel(q[one], k, v, slot, positions[one], span, scale, tables[one])
        assert torch.equal(alone[0], together[row]), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,block", [(64, 32), (64, 40), (128, 16), (16, 24)])
def test_a_requests_tokens_passed_as_rows_have_the_bits_each_has_alone(
    kernel: CpuKernels, dtype: torch.dtype, dim: int, block: int
) -> None:
    """A prefill launch passes each token as a row; consecutive rows reading the same blocks
    share their passes over the keys (on AMX, one tile product scores 16 queries), yet each
    token's output is the one it gets alone, as a decode row, and agrees with masked
    attention over its blocks (block sizes that are not a multiple of 16 included). The
    queries read in place from a fused projection's output give the same bits."""
    heads, kv_heads, blocks = 9, 3, 12
    generator = torch.Generator().manual_seed(dim + block)
    k = torch.randn(blocks, kv_heads, block, dim, generator=generator).to(dtype)
    v = torch.randn(blocks, kv_heads, block, dim, generator=generator).to(dtype)
    mine, other = torch.randperm(blocks, generator=generator), torch.arange(blocks)
    tokens, first = 23, 3 * block + 5  # positions first.. of one request
    span = blocks * block
    # rows: one of another request, the 23 tokens, two more of the other request
    tables = torch.stack([other] + [mine] * tokens + [other] * 2)
    positions = torch.tensor([7] + list(range(first, first + tokens)) + [90, 91])[:, None]
    q = torch.randn(len(tables), 1, heads, dim, generator=generator).to(dtype)
    slots = torch.zeros(len(tables), dtype=torch.long)
    together = kernel(q, k, v, slots, positions, span, dim**-0.5, tables)
    assert_each_row_as_alone(kernel, together, q, k, v, positions, span, tables)
    # the queries as a fused projection's output holds them: keys and values after each
    fused = torch.randn(len(tables), 1, heads + 2 * kv_heads, dim, generator=generator)
    fused = fused.to(dtype).flatten(2)
    fused[..., : heads * dim] = q.flatten(2)
    sliced = fused[..., : heads * dim].view(len(tables), 1, heads, dim)
    assert not sliced.is_contiguous()
    assert torch.equal(kernel(sliced, k, v, slots, positions, span, dim**-0.5, tables), together)

    # the same through masked attention over each row's blocks laid end to end
    def laid(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return cache[table].transpose(0, 1).reshape(1, kv_heads, span, -1)

    for row in (0, 1, tokens, tokens + 2):
        want = masked_reference(
            q[row : row + 1].float(),
            laid(k, tables[row]).float(),
            laid(v, tables[row]).float(),
            torch.tensor([0]),
            positions[row : row + 1],
            span,
        )
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(together[row].float(), want[0].to(dtype).float(), atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,block", [(64, 32), (128, 24)])
def test_decode_rows_sharing_a_cached_prefix_have_the_bits_each_has_alone(
    kernel: CpuKernels, dtype: torch.dtype, dim: int, block: int
) -> None:
    """Decode rows whose tables begin with the same blocks (a cached system prompt) and go
    on in blocks of their own: on AMX tiles they share the products over the common blocks,
    yet each row's output is the one it gets alone, and none reads past its own keys (the
    blocks after them hold NaN here)."""
    heads, kv_heads, blocks = 9, 3, 40
    generator = torch.Generator().manual_seed(dim)
    k = torch.randn(blocks, kv_heads, block, dim, generator=generator).to(dtype)
    v = torch.randn(blocks, kv_heads, block, dim, generator=generator).to(dtype)
    k[-1], v[-1] = float("nan"), float("nan")  # what tables name past a row's keys
    prefix, width, rows = [0, 1, 2, 3], 8, 9
    tables, positions = [], []
    for row in range(rows):
        at = 4 * block + (row * 7) % (2 * block) if row != 3 else 2 * block + 5
        own = [4 + 3 * row] + ([5 + 3 * row] if at >= 5 * block else [])  # blocks it holds
        first = prefix if row != 6 else [30, 31, 32, 33]  # one row of another prompt
        tables.append((first + own + [blocks - 1] * width)[:width])
        positions.append(at)
    table = torch.tensor(tables)
    position = torch.tensor(positions)[:, None]
    q = torch.randn(rows, 1, heads, dim, generator=generator).to(dtype)
    slots, span = torch.zeros(rows, dtype=torch.long), width * block
    together = kernel(q, k, v, slots, position, span, dim**-0.5, table)
    assert torch.isfinite(together.float()).all()
    assert_each_row_as_alone(kernel, together, q, k, v, position, span, table)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim,block", [(64, 32), (64, 40), (128, 24)])
def test_tokens_of_requests_sharing_some_blocks_have_the_bits_each_has_alone(
    kernel: CpuKernels, threads: int, dim: int, block: int
) -> None:
    """A launch's runs of tokens reading the same blocks have their values made into tile
    operands once per thread (on AMX), kept from one run to the next as far as the blocks
    match: tokens of a request, then of one sharing only its first blocks, then of one
    sharing none, then of the first again. Each token has the bits it gets alone, and none
    reads a block past its keys (those hold NaN here)."""
    heads, kv_heads, blocks = 9, 3, 16
    generator = torch.Generator().manual_seed(dim + block + threads)
    k = torch.randn(blocks, kv_heads, block, dim, generator=generator).to(torch.bfloat16)
    v = torch.randn(blocks, kv_heads, block, dim, generator=generator).to(torch.bfloat16)
    k[-1], v[-1] = float("nan"), float("nan")  # what tables name past a row's keys
    width = 6
    first, second, third = [0, 1, 2, 3, 4], [0, 1, 7, 8, 9], [10, 11, 12, 13, 14]
    runs = [(first, 4 * block + 3, 9), (second, 3 * block + 30, 11), (third, 2 * block, 7)]
    runs.append((first, 4 * block + 12, 6))  # the first request's later tokens
    tables, positions = [], []
    for table, start, count in runs:  # a request's tokens: its table, as far as they reach
        held = (start + count - 1) // block + 1
        for position in range(start, start + count):
            tables.append((table[:held] + [blocks - 1] * width)[:width])
            positions.append(position)
    table, position = torch.tensor(tables), torch.tensor(positions)[:, None]
    q = torch.randn(len(tables), 1, heads, dim, generator=generator).to(torch.bfloat16)
    slots, span = torch.zeros(len(tables), dtype=torch.long), width * block
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernel(q, k, v, slots, position, span, dim**-0.5, table)
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(together.float()).all()
    assert_each_row_as_alone(kernel, together, q, k, v, position, span, table)


SETTINGS = Settings(
    model="tiny", device="cpu", max_model_len=512, kv_slots_per_rank=8, decode_batch=4
)


def tiny_with(decode_kernel: bool) -> LoadedModel:
    """The tiny model in float32 with the CPU's layers, its kernels on or off."""
    device = torch.device("cpu")
    kit = kit_for(device, decode_kernel=decode_kernel)
    path = resolve_model_dir(SETTINGS.model)
    return load_model(path, SETTINGS.dtype, device, SETTINGS.max_kv_len, kit=kit)


def library_of(loaded: LoadedModel) -> CpuKernels | None:
    """The CPU kernels the model's layers call, if any."""
    kit = loaded.model.kit
    return kit.library if isinstance(kit, CpuKit) else None


def decode_logits(loaded: LoadedModel) -> tuple[LaunchRunner, torch.Tensor]:
    """Prefill four prompts, then one decode launch of all four rows."""
    shapes = launch_shapes(8, SETTINGS.max_kv_len, SETTINGS.prefill_chunk, 4)
    runner = LaunchRunner(loaded.model, shapes)
    rng = random.Random(3)
    prompts = [random_prompt(rng, n, loaded.config.vocab_size) for n in (9, 60, 140, 3)]
    for slot, prompt in enumerate(prompts):
        for start in range(0, len(prompt), runner.prefill_chunk):
            prefill_logits(runner, slot, prompt[start : start + runner.prefill_chunk], start)
    positions = [len(p) for p in prompts]
    return runner, runner.decode([0, 1, 2, 3], [5, 6, 7, 8], positions)


def test_cpu_decode_launches_run_the_kernel_and_agree_with_batched_products(
    kernel: CpuKernels,
) -> None:
    kernel_model, plain_model = tiny_with(decode_kernel=True), tiny_with(decode_kernel=False)
    with_kernel, ours = decode_logits(kernel_model)
    without, theirs = decode_logits(plain_model)
    assert library_of(kernel_model) is not None
    assert with_kernel.backend.name == "eager+decode-kernel"
    assert library_of(plain_model) is None
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "/bin/false"])
def test_without_a_working_compiler_launches_fall_back_to_batched_products(
    monkeypatch: pytest.MonkeyPatch, compiler: str
) -> None:
    monkeypatch.setenv("CC", compiler)
    assert load_cpu_kernels() is None
    loaded = tiny_with(decode_kernel=True)
    runner, logits = decode_logits(loaded)
    assert library_of(loaded) is None
    assert runner.backend.name == "eager"
    assert torch.isfinite(logits).all()


def test_auto_dtype_is_bfloat16_where_the_cpu_runs_bfloat16_faster() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native, plain = frozenset({"avx512f", "avx512_bf16"}), frozenset({"sse4_2", "avx"})
    assert auto_dtype(torch.float32, cpu, native) == torch.bfloat16
    assert auto_dtype(torch.float32, cpu, frozenset({"amx_bf16"})) == torch.bfloat16
    # the kernels' own product widens bfloat16 weights in registers: AVX2 with FMA, AVX-512
    assert auto_dtype(torch.float32, cpu, frozenset({"avx2", "fma"})) == torch.bfloat16
    assert auto_dtype(torch.float32, cpu, frozenset({"avx512f", "avx512bw"})) == torch.bfloat16
    assert auto_dtype(torch.float32, cpu, frozenset({"avx2"})) == torch.float32
    assert auto_dtype(torch.float32, cpu, plain) == torch.float32
    assert auto_dtype(torch.float16, cpu, plain) == torch.bfloat16
    assert auto_dtype(torch.bfloat16, cpu, plain) == torch.bfloat16
    assert auto_dtype(torch.float32, cuda, native) == torch.float32
    expected = torch.bfloat16 if cpu_prefers_bf16() else torch.float32
    assert load_reference_model(SETTINGS.model_copy(update={"dtype": "auto"})).dtype == expected


@pytest.fixture(scope="module")
def loaded_bf16() -> LoadedModel:
    return load_reference_model(SETTINGS.model_copy(update={"dtype": "bfloat16"}))


def test_bfloat16_decode_rows_are_bit_identical_alone_or_together(
    kernel: CpuKernels, loaded_bf16: LoadedModel
) -> None:
    runner, together = decode_logits(loaded_bf16)
    assert runner.state.k[0].dtype == torch.bfloat16
    rng = random.Random(3)
    prompts = [random_prompt(rng, n, loaded_bf16.config.vocab_size) for n in (9, 60, 140, 3)]
    shapes = launch_shapes(8, SETTINGS.max_kv_len, SETTINGS.prefill_chunk, 4)
    for slot, prompt in enumerate(prompts):
        alone = LaunchRunner(loaded_bf16.model, shapes)
        for start in range(0, len(prompt), alone.prefill_chunk):
            prefill_logits(alone, slot, prompt[start : start + alone.prefill_chunk], start)
        logits = alone.decode([slot], [5 + slot], [len(prompt)])
        assert torch.equal(logits[0], together[slot])


def test_bfloat16_decode_logits_are_bit_identical_whatever_span_or_layout(
    kernel: CpuKernels, loaded_bf16: LoadedModel
) -> None:
    shapes = launch_shapes(8, SETTINGS.max_kv_len, SETTINGS.prefill_chunk, 4)
    runner = LaunchRunner(loaded_bf16.model, shapes)
    prompt = random_prompt(random.Random(0), 100, loaded_bf16.config.vocab_size)
    for start in range(0, len(prompt), runner.prefill_chunk):
        prefill_logits(runner, 2, prompt[start : start + runner.prefill_chunk], start)
    scratch = runner.state.scratch_position
    outputs = []
    for span, window in [(128, 2), (256, 2), (512, 0), (512, None)]:
        slots = list(range(window, window + 4)) if window is not None else [2, 0, 0, 0]
        row = 2 - window if window is not None else 0
        ids, positions = [[0]] * 4, [[scratch]] * 4
        ids[row], positions[row] = [7], [len(prompt)]
        launch = LaunchInputs(
            torch.tensor(ids),
            torch.tensor(positions),
            torch.tensor(slots),
            torch.zeros(4, 1, dtype=torch.long),
            span,
            window,
        )
        outputs.append(loaded_bf16.model(launch, runner.state).logits[row, 0])
    for other in outputs[1:]:
        assert torch.equal(outputs[0], other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_is_rotate_half_and_write_cache_bit_for_bit(
    kernel: CpuKernels, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(9)
    tokens, heads, kv_heads, dim = 7, 9, 3, 64
    q = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    cos, sin = torch.randn(2, tokens, dim, generator=generator)
    k_cache = torch.zeros(SLOTS, kv_heads, POSITIONS, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 3, 5, 3, 1, 0, 2])
    positions = torch.tensor([0, 17, 255, 18, 4, 1, SCRATCH])
    expected_q = rotate_half(q[None], cos[None, :, None], sin[None, :, None])[0]
    expected_k = rotate_half(k[None], cos[None, :, None], sin[None, :, None])[0]
    rotated = q.clone()
    kernel.rope_store(rotated, k, v, cos, sin, k_cache, v_cache, slots, positions)
    assert torch.equal(rotated, expected_q)
    assert torch.equal(k_cache[slots, :, positions], expected_k)
    assert torch.equal(v_cache[slots, :, positions], v)
    written = torch.zeros(SLOTS, POSITIONS, dtype=torch.bool)
    written[slots, positions] = True
    assert not k_cache.transpose(1, 2)[~written].any()  # nothing else written


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefilled_prompt_gives_the_logits_of_decoding_it_token_by_token(
    kernel: CpuKernels, dtype: str
) -> None:
    """Prefill chunks pass each token to the kernel as a row of its own, so the prompt's last
    logits are those of feeding it one decode launch at a time: bit for bit in bfloat16,
    whose packed products at the tiny model's widths do not depend on the row count (AMX
    kernels at wider ones do, docs/architecture.md §2)."""
    loaded = load_reference_model(SETTINGS.model_copy(update={"dtype": dtype}))
    shapes = launch_shapes(8, SETTINGS.max_kv_len, SETTINGS.prefill_chunk, 4)
    prompt = random_prompt(random.Random(8), 150, loaded.config.vocab_size)
    chunked = LaunchRunner(loaded.model, shapes)
    for start in range(0, len(prompt), chunked.prefill_chunk):
        logits = prefill_logits(chunked, 3, prompt[start : start + chunked.prefill_chunk], start)
    stepped = LaunchRunner(loaded.model, shapes)
    for position, token in enumerate(prompt):
        by_decode = stepped.decode([3], [token], [position])
    if dtype == "bfloat16":
        assert torch.equal(logits[0], by_decode[0])
    else:  # MKL's float32 products differ in their last bits between 1 row and 128
        torch.testing.assert_close(logits[0], by_decode[0], rtol=1e-5, atol=1e-5)


def test_rms_norm_is_the_torch_rms_norm(kernel: CpuKernels) -> None:
    """bit for bit in bfloat16 (a NaN row stays NaN); float32 to its rounding."""
    generator = torch.Generator().manual_seed(12)
    for dtype in (torch.bfloat16, torch.float32):
        norm = RMSNorm(576, 1e-5).to(dtype)
        norm.weight.data = torch.randn(576, generator=generator).to(dtype)
        x = torch.randn(33, 1, 576, generator=generator).to(dtype)
        x[3, 0, 7] = float("nan")
        with torch.no_grad():
            expected = norm(x)
        ours = kernel.rms_norm(x, norm.weight.detach(), 1e-5)
        if dtype == torch.bfloat16:
            assert torch.equal(ours.isnan(), expected.isnan())
            assert torch.equal(ours.nan_to_num(), expected.nan_to_num())
        else:
            torch.testing.assert_close(ours, expected, equal_nan=True)
