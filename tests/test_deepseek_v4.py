"""DeepSeek-V4 (docs/architecture.md §8): tiny random checkpoints written by `transformers`,
every layer type (sliding, CSA, HCA) and both MoE kinds present, are served with the tokens
of `transformers`' own greedy `generate` (one prompt at a time: its V4 is right only at
batch size 1), with small windows and with V4-Flash's 128/4/128; the indexer's ties go to
the lowest entry whatever the launch; per-slot state is the size its formula says; through
a real pool, two expert-parallel ranks serve 48 concurrent requests with the tokens each
gets alone on one rank, a rank killed mid-decode changes no token, and prefix hits in a
cache of blocks (with MTP) get the misses' tokens and logprobs; with the MTP module
greedy tokens are those without it and sampled ones follow the same distribution, and a
rejected draft at a window boundary leaves nothing a later launch reads; FP8 attention
weights load as their dequantized blocks, and so does a checkpoint in DeepSeek's release
layout (bare names, `compress_ratios`, UE8M0 `X.scale` block scales); FP4 experts:
tests/test_stored_weights.py."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from npu_worker.models.config import UnsupportedModel
from npu_worker.models.deepseek_v4.config import DeepseekV4Config, state_elements_per_slot
from npu_worker.models.deepseek_v4.model import DeepseekV4CausalLM
from npu_worker.models.deepseek_v4.state import DeepseekV4State
from npu_worker.models.launch import LaunchInputs
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import load_model
from producer.client import Client
from producer.status import collect_status
from schemas.keys import Keys
from tests.conftest import StartPool
from tests.helpers import (
    TIE_TOLERANCE,
    check_prefix_hits_match_misses,
    check_stream,
    random_prompt,
    wait_until,
)
from tests.reference import (
    ReferenceCompletion,
    beside_differs,
    first_divergence,
    hf_greedy,
    launch_shapes,
    layer_kits,
    lone_runs,
    prefill_logits,
)

make = pytest.importorskip("npu_worker.weights.makers.deepseek_v4")
MAX_MODEL_LEN = 768
PROMPT_LENGTHS = (20, 150, 300, 600)
NEW_TOKENS = 64


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """This process computes on one thread: a pool's ranks hold the other cores, and V4's
    many small operations slow down badly on contended threads (measured: 127 s against
    8 s for the 48-request references)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small windows (16, rates 4/16) and V4-Flash's (128, rates 4/128)."""
    root = tmp_path_factory.mktemp("deepseek_v4")
    made = {windows: root / windows for windows in ("small", "real")}
    for windows, path in made.items():
        make.build(path, windows, mtp=windows == "small")
    return made


def lone(path: Path, prompts: list[list[int]], max_tokens: int) -> list[ReferenceCompletion]:
    """Each prompt run alone on one rank holding every expert."""
    return lone_runs(path, "float32", prompts, max_tokens, MAX_MODEL_LEN)


def transformers_model(path: Path) -> torch.nn.Module:
    import transformers

    return transformers.DeepseekV4ForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("windows", ["small", "real"])
def test_chunked_prefill_and_decode_give_the_tokens_of_transformers_generate(
    windows: str, checkpoints: dict[str, Path]
) -> None:
    path = checkpoints[windows]
    model = transformers_model(path)
    rng = random.Random(21)
    prompts = [random_prompt(rng, n, make.VOCAB_SIZE) for n in PROMPT_LENGTHS]
    for prompt, reference in zip(prompts, lone(path, prompts, NEW_TOKENS)):
        wanted = hf_greedy(model, prompt, NEW_TOKENS)
        problem = first_divergence(reference.token_ids, wanted, TIE_TOLERANCE)
        assert problem is None, f"{windows} windows, prompt of {len(prompt)}: {problem}"


def test_indexer_ties_go_to_the_lowest_entries_whatever_the_span(
    checkpoints: dict[str, Path],
) -> None:
    loaded = load_model(checkpoints["small"], "float32", torch.device("cpu"), MAX_MODEL_LEN)
    model = loaded.model
    assert isinstance(model, DeepseekV4CausalLM)
    indexers = [
        layer.attn.indexer for layer in model.model.layers if hasattr(layer.attn, "indexer")
    ]
    assert indexers
    with torch.no_grad():
        for indexer in indexers:  # every score is relu(0) = 0: all entries tie
            indexer.wq_b.weight.zero_()
    # the tie itself: the lowest `index_topk` closed entries, for every query
    indexer, config = indexers[0], model.config
    batch, seq, entries = 2, 3, 40
    keys = torch.randn(batch, entries, config.index_head_dim)
    closed = torch.arange(entries)[None, None] < torch.tensor([[5, 20, 40], [0, 9, 33]])[..., None]
    x, q_low = (
        torch.randn(batch, seq, config.hidden_size),
        torch.randn(batch, seq, config.q_lora_rank),
    )
    cos, sin = (
        torch.ones(batch, seq, config.rope_dim // 2),
        torch.zeros(batch, seq, config.rope_dim // 2),
    )
    seen = indexer(x, q_low, keys, cos, sin, closed)
    lowest = torch.arange(entries)[None, None] < config.index_topk
    assert torch.equal(seen, closed & lowest)
    # and a request's logits do not depend on the span or the row its launch reads
    runner = LaunchRunner(model, launch_shapes(4, MAX_MODEL_LEN, 128, 4))
    rng = random.Random(22)
    prompt, other = (
        random_prompt(rng, 90, make.VOCAB_SIZE),
        random_prompt(rng, 500, make.VOCAB_SIZE),
    )
    for slot, tokens in ((0, prompt), (2, other)):
        for start in range(0, len(tokens), 128):
            prefill_logits(runner, slot, tokens[start : start + 128], start)
    alone = runner.decode([0], [7], [len(prompt)]).clone()
    beside = runner.decode([2, 0], [9, 7], [len(other), len(prompt)])[1]
    assert torch.equal(alone[0], beside)


@pytest.mark.parametrize("kit", list(layer_kits()))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_layer_kit_runs_v4_with_the_tokens_of_a_lone_run(
    kit: str, dtype: str, checkpoints: dict[str, Path]
) -> None:
    """Plain torch layers, the CPU's with its kernels and without them: each serves the
    model, a request's tokens the same whatever shares its launch."""
    path, cpu = checkpoints["small"], torch.device("cpu")
    loaded = load_model(path, dtype, cpu, MAX_MODEL_LEN, kit=layer_kits()[kit]())
    rng = random.Random(25)
    prompts = [random_prompt(rng, n, make.VOCAB_SIZE) for n in (40, 130, 9)]
    shapes = launch_shapes(4, MAX_MODEL_LEN, 128, 4)
    problem = beside_differs(loaded.model, shapes, prompts, TIE_TOLERANCE)
    assert problem is None, f"{kit}, {dtype}: {problem}"


def test_a_pool_without_the_decode_kernel_serves_v4(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client
) -> None:
    path = checkpoints["small"]
    start_pool(model=str(path), decode_kernel=False, max_model_len=MAX_MODEL_LEN)
    rng = random.Random(26)
    prompts = [random_prompt(rng, n, make.VOCAB_SIZE) for n in (12, 140)]
    ids = [client.submit(prompt_token_ids=p, max_tokens=8, ignore_eos=True) for p in prompts]
    for request_id, reference in zip(ids, lone(path, prompts, 8), strict=True):
        tokens = check_stream(list(client.stream(request_id, timeout_s=120)))
        assert first_divergence(tokens, reference, TIE_TOLERANCE) is None, request_id


def test_per_slot_state_is_the_size_its_formula_says(checkpoints: dict[str, Path]) -> None:
    loaded = load_model(checkpoints["real"], "float32", torch.device("cpu"), MAX_MODEL_LEN)
    config = loaded.model.config
    state = loaded.model.new_state(3, MAX_MODEL_LEN)
    assert isinstance(state, DeepseekV4State)
    buffers = [r.rows for r in state.window]
    buffers += [e.rows for e in (*state.entries, *state.index_keys) if e is not None]
    buffers += [r.rows for r in (*state.projections, *state.index_projections) if r is not None]
    allocated = sum(b.numel() * b.element_size() for b in buffers)
    assert allocated == 3 * state.bytes_per_slot
    counts = state_elements_per_slot(config, MAX_MODEL_LEN)
    d, window = config.head_dim, config.sliding_window
    assert counts["window"] == config.num_layers * (window + 2) * d
    assert counts["entries"] == (2 * (MAX_MODEL_LEN // 4 + 1) + MAX_MODEL_LEN // 128 + 1) * d


def test_expert_parallel_ranks_serve_48_concurrent_requests_as_one_rank_serves_each_alone(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client, redis_client
) -> None:
    path = checkpoints["small"]
    start_pool(
        model=str(path),
        ranks=2,
        expert_parallel=True,
        decode_batch=8,
        kv_slots_per_rank=24,
        max_model_len=MAX_MODEL_LEN,
    )
    rng = random.Random(23)
    lengths = [600, 300, *(rng.randint(3, 140) for _ in range(46))]
    cases = [(random_prompt(rng, n, make.VOCAB_SIZE), 16) for n in lengths]
    ids = [client.submit(prompt_token_ids=p, max_tokens=m, ignore_eos=True) for p, m in cases]
    references = lone(path, [p for p, _ in cases], 16)
    for request_id, reference, (prompt, _) in zip(ids, references, cases):
        tokens = check_stream(list(client.stream(request_id, timeout_s=240)))
        problem = first_divergence(tokens, reference, TIE_TOLERANCE)
        assert problem is None, f"prompt of {len(prompt)}: {problem}"
    groups = redis_client.hgetall(Keys().rendezvous("default"))
    assert groups[b"generation"] and groups[b"address"]  # the ranks really formed a group


def test_killing_an_expert_parallel_rank_mid_decode_loses_nothing_and_changes_no_token(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client, redis_client
) -> None:
    path = checkpoints["real"]
    pool = start_pool(
        model=str(path),
        ranks=2,
        expert_parallel=True,
        decode_batch=4,
        kv_slots_per_rank=8,
        max_model_len=MAX_MODEL_LEN,
        rank_timeout_s=3,
        collective_timeout_s=10,
    )
    rng = random.Random(24)
    cases = [(random_prompt(rng, rng.randint(3, 300), make.VOCAB_SIZE), 48) for _ in range(6)]
    ids = [
        client.submit(prompt_token_ids=p, max_tokens=m, ignore_eos=True, request_id=f"v4k{i}")
        for i, (p, m) in enumerate(cases)
    ]
    keys = Keys()

    def published() -> int:
        pipe = redis_client.pipeline(transaction=False)
        for request_id in ids:
            pipe.xlen(keys.result(request_id))
        return sum(pipe.execute())

    wait_until(lambda: published() > 40, timeout_s=120, what="decode to be under way")
    pool.processes.kill("rank1")
    references = lone(path, [p for p, _ in cases], 48)
    for request_id, reference in zip(ids, references):
        tokens = check_stream(list(client.stream(request_id, timeout_s=240)))
        problem = first_divergence(tokens, reference, TIE_TOLERANCE)
        assert problem is None, f"{request_id}: {problem}"
    assert {c.name: c.restarts for c in pool.processes.children}["rank1"] >= 1
    wait_until(lambda: redis_client.xlen(keys.requests) == 0, what="every entry deleted")
    assert redis_client.xlen(keys.dead) == 0


def test_expert_parallel_prefix_hits_with_mtp_give_the_tokens_and_logprobs_of_misses(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client
) -> None:
    """Two expert-parallel ranks with MTP and a cache of blocks, the same requests with
    prefix caching on and off (one pool after the other): the hits restore the rings from
    the mark where their shared blocks end and get the misses' tokens and logprobs bit for
    bit, greedy and seeded sampling alike. With MTP the last cached position is computed
    again, and V4's unpacked prefill resumes on a chunk's boundary: the first block's end."""
    path = checkpoints["small"]
    probe = load_model(path, "float32", torch.device("cpu"), MAX_MODEL_LEN, mtp=True).model
    state = probe.new_state(1, 128, 128, 1)
    check_prefix_hits_match_misses(
        start_pool,
        client,
        make.VOCAB_SIZE,
        seed=80,
        cached=128,
        model=str(path),
        ranks=2,
        expert_parallel=True,
        mtp=True,
        decode_batch=4,
        kv_slots_per_rank=8,
        kv_cache_memory=48 * 128 * state.bytes_per_token + 8 * state.fixed_bytes,
        max_model_len=MAX_MODEL_LEN,
    )


def test_a_rejected_draft_at_a_window_boundary_leaves_nothing_a_later_launch_reads(
    checkpoints: dict[str, Path],
) -> None:
    loaded = load_model(checkpoints["small"], "float32", torch.device("cpu"), MAX_MODEL_LEN)
    model = loaded.model
    runner = LaunchRunner(model, launch_shapes(2, MAX_MODEL_LEN, 128, 1))
    rng = random.Random(25)
    prompt = random_prompt(rng, 159, make.VOCAB_SIZE)
    draft_position = 159  # closes a CSA and an HCA window
    assert (draft_position + 1) % model.config.hca_rate == 0
    for slot in (0, 1):
        for start in (0, 128):
            prefill_logits(
                runner, slot, prompt[start : min(start + 128, draft_position - 1)], start
            )

    def verify(slot: int, tokens: list[int]) -> None:
        launch = LaunchInputs(
            input_ids=torch.tensor([tokens]),
            positions=torch.tensor([[draft_position - 1, draft_position]]),
            slot_ids=torch.tensor([slot]),
            logit_index=torch.tensor([[0, 1]]),
            span=160,
            window_start=None,
        )
        model(launch, runner.state)

    right = 11
    verify(0, [prompt[-1], (right + 1) % make.VOCAB_SIZE])  # rejected: fed again below
    verify(1, [prompt[-1], right])  # accepted, then fed again as slot 0's is
    token = [right, right]
    for position in range(draft_position, draft_position + 24):
        logits = [runner.decode([slot], [token[slot]], [position])[0] for slot in (0, 1)]
        assert torch.equal(logits[0], logits[1]), f"position {position}"
        token = [int(logits[0].argmax())] * 2


def test_greedy_with_the_mtp_module_equals_greedy_without(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client
) -> None:
    path = checkpoints["small"]
    start_pool(
        model=str(path),
        ranks=2,
        expert_parallel=True,
        mtp=True,
        decode_batch=4,
        max_model_len=MAX_MODEL_LEN,
    )
    rng = random.Random(26)
    prompts = [random_prompt(rng, n, make.VOCAB_SIZE) for n in (5, 40, 130, 300)]
    ids = [client.submit(prompt_token_ids=p, max_tokens=40, ignore_eos=True) for p in prompts]
    for request_id, reference in zip(ids, lone(path, prompts, 40)):
        tokens = check_stream(list(client.stream(request_id, timeout_s=180)))
        assert first_divergence(tokens, reference, TIE_TOLERANCE) is None

    def mtp() -> dict:
        return collect_status(client.redis, client.keys)["pools"][0]["mtp"]

    wait_until(lambda: mtp()["proposed"] > 0, what="drafts counted")
    counts = mtp()
    print("DeepSeek-V4, its fitted MTP module:", counts)
    assert 0 < counts["accepted"] < counts["proposed"]  # both the accept and reject paths ran


def test_sampled_tokens_with_the_mtp_module_follow_the_same_distribution(
    checkpoints: dict[str, Path],
) -> None:
    from tests.test_mtp import chi_square_ok, sample_paths

    path = checkpoints["small"]
    plain = load_model(path, "float32", torch.device("cpu"), MAX_MODEL_LEN)
    drafted = load_model(path, "float32", torch.device("cpu"), MAX_MODEL_LEN, mtp=True)
    assert chi_square_ok(sample_paths(plain, 800, 0), sample_paths(drafted, 800, 100_000))


def test_bfloat16_weights_give_the_float32_logits_to_bfloat16_precision(
    checkpoints: dict[str, Path],
) -> None:
    """What V4 keeps in float32 (norms, sinks, `ape`, hyper-connections, routers) stays so,
    and the rest runs in bfloat16 (the dtype `--dtype auto` picks on CPUs with bf16)."""
    path = checkpoints["small"]
    rng = random.Random(24)
    prompts = [random_prompt(rng, n, make.VOCAB_SIZE) for n in (20, 150, 300)]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(path, dtype, torch.device("cpu"), MAX_MODEL_LEN)
        model = loaded.model
        assert isinstance(model, DeepseekV4CausalLM)
        kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
        assert any(".ffn.gate." in n for n in kept) and any("hc_attn" in n for n in kept)
        if dtype == "bfloat16":  # the projections, the compressors' gates among them
            assert not any("compressor.wgate" in n or ".wq_a." in n for n in kept)
        runner = LaunchRunner(model, launch_shapes(1, MAX_MODEL_LEN, 128, 1))
        logits[dtype] = []
        for prompt in prompts:
            for start in range(0, len(prompt), 128):
                last = prefill_logits(runner, 0, prompt[start : start + 128], start)
            logits[dtype].append(last.float())
    for want, got in zip(logits["float32"], logits["bfloat16"]):
        assert torch.nn.functional.cosine_similarity(want, got, dim=-1).min() > 0.999


def test_fp8_attention_weights_load_as_their_dequantized_blocks(tmp_path: Path) -> None:
    path = tmp_path / "fp8"
    make.build(path, "small", fp8=True)
    stored = load_file(str(path / "model.safetensors"))
    model = load_model(path, "float32", torch.device("cpu"), MAX_MODEL_LEN).model
    quantized = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    assert len(quantized) >= 4 * 5 and all(".attn." in k for k in quantized)
    for name in quantized:
        want = block_by_block(stored[name], stored[name + "_scale_inv"])
        layer = model.get_submodule(name.removesuffix(".weight"))
        assert layer.stored is not None, name  # kept as stored, widened when read
        assert torch.equal(layer.weight.detach(), want), name


def block_by_block(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An FP8 weight times its 128x128 blocks' scales, one block at a time, as the format
    defines it."""
    want = fp8.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            want[rows, cols] *= scale[i, j].float()
    return want


def test_a_checkpoint_in_deepseeks_release_layout_loads_as_its_transformers_copy(
    tmp_path: Path,
) -> None:
    """Bare names, the release's config terms and UE8M0 `X.scale` block scales: the same
    configuration, rotary tables and weights (FP8 ones as their blocks dequantized)."""
    saved, released = tmp_path / "transformers", tmp_path / "release"
    make.build(saved, "small", mlp_layers=make.HASH_FIRST)
    make.release_layout(saved, released, fp8=True)
    config = json.loads((released / "config.json").read_text())
    assert "layer_types" not in config and "mlp_layer_types" not in config
    stored = load_file(str(released / "model.safetensors"))
    assert "embed.weight" in stored and "hc_head_fn" in stored
    quantized = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    assert len(quantized) >= 4 * 5
    scales = {k: stored[k.removesuffix(".weight") + ".scale"] for k in quantized}
    assert {v.dtype for v in scales.values()} == {torch.float8_e8m0fnu}

    plain, release = (
        load_model(path, "float32", torch.device("cpu"), MAX_MODEL_LEN)
        for path in (saved, released)
    )
    for field in fields(DeepseekV4Config):
        if field.name not in ("main_rope", "compress_rope"):  # as tables, below
            assert getattr(release.config, field.name) == getattr(plain.config, field.name), field
    assert isinstance(plain.model, DeepseekV4CausalLM)
    assert isinstance(release.model, DeepseekV4CausalLM)
    for name, (cos, sin) in plain.model.ropes().items():
        other = release.model.ropes()[name]
        assert torch.equal(cos, other[0]) and torch.equal(sin, other[1]), name
    weights = dict(release.model.named_parameters())
    dequantized = 0
    for name, param in plain.model.named_parameters():
        key = make.release_name(name)
        if key in scales:
            want = block_by_block(stored[key], scales[key])
            assert (want - param).abs().max() <= param.abs().max() / 8, name  # e4m3: 3 bits
            dequantized += 1
            got = release.model.get_submodule(name.removesuffix(".weight")).weight
        else:
            want, got = param.detach(), weights[name]
        assert torch.equal(got.detach(), want), name
    assert dequantized == len(quantized)

    config["quantization_config"]["scale_fmt"] = "e5m2"  # a scale format it does not know
    (released / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="scale_fmt 'e5m2'"):
        load_model(released, "float32", torch.device("cpu"), MAX_MODEL_LEN)
