"""Prefix caching is exact (docs/architecture.md §3b, §3c): requests whose prompts start
with blocks another request computed skip those blocks' prefill, copied from a running
request's slot or found in a freed one (or, in a cache of blocks, holding the same blocks),
and get the tokens and logprobs they get with prefix caching off, bit for bit: greedy and
seeded sampling, with and without MTP, for Llama, DeepSeek-V3 and DeepSeek-V4 (whose rings
come back from marks, in a cache of blocks only). A cache of blocks too small for every
request at once preempts and resumes them with the same tokens (not yet bit for bit for
DeepSeek-V4, whose recomputed tokens differ in their last bits: marked). The planner and a
rank run in this process, as the pool runs them."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from batcher.dispatch import rank_plans
from batcher.intake import Tracked
from batcher.outcomes import apply_result
from batcher.prefix import block_keys
from batcher.scheduler import PlannerConfig, PoolState, Sequence, join_rank, plan_step
from npu_worker.runner import LaunchRunner
from npu_worker.weights.loader import LoadedModel, load_model
from npu_worker.weights.presets import resolve_model_dir
from schemas.config import Settings
from schemas.constraints import Constraint, Regex
from schemas.control import StepResult
from schemas.messages import GenerateRequest, SamplingParams
from tests.helpers import LocalRank, random_prompt

MAX_MODEL_LEN = 512
MAX_TOKENS = 8


@dataclass(slots=True)
class Served:
    """What each request got, and how the planner placed the hits."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    copied: int = 0  # hits copied from another slot
    in_place: int = 0  # hits found in the slot they took
    shared: int = 0  # hits holding another request's blocks (a cache of blocks)
    preempted: int = 0  # requests preempted for want of blocks
    most_running: int = 0
    accepted: int = 0  # MTP drafts accepted
    admitted_at: dict[str, int] = field(default_factory=dict)  # the step, first admission
    errors: dict[str, str] = field(default_factory=dict)


def workload(vocab_size: int) -> list[tuple[int, list[int], SamplingParams]]:
    """(arrival step, prompt, sampling): a shared 300-token system prompt with distinct
    questions, arriving while the first decodes and after everything ended; one prompt
    exactly two blocks long, and one the system prompt alone."""
    rng = random.Random(7)
    system = random_prompt(rng, 300, vocab_size)
    arrivals: list[tuple[int, list[int]]] = [(0, system + random_prompt(rng, 20, vocab_size))]
    arrivals += [
        (3, system + random_prompt(rng, rng.randrange(5, 60), vocab_size)) for _ in range(3)
    ]
    arrivals += [(3, system[:256])]
    arrivals += [
        (40, system + random_prompt(rng, rng.randrange(5, 60), vocab_size)) for _ in range(3)
    ]
    arrivals += [(40, system), (40, random_prompt(rng, 200, vocab_size))]
    requests = []
    for i, (step, prompt) in enumerate(arrivals):
        sampled = i % 2 == 1
        sampling = SamplingParams(
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            logprobs=2,
            temperature=0.9 if sampled else 0.0,
            seed=1000 + i if sampled else None,
        )
        requests.append((step, prompt, sampling))
    return requests


def serve(
    loaded: LoadedModel,
    prefix_caching: bool,
    mtp: bool,
    blocks: int = 0,
    block_size: int = 128,
    requests: list[tuple[int, list[int], SamplingParams]] | None = None,
    lag: int = 0,
    constraints: dict[str, Constraint] | None = None,
) -> Served:
    """Serve the workload (or `requests`) on one rank: slots reserving every position, or
    a cache of `blocks` blocks of `block_size` tokens. Each step's result reaches the
    planner `lag` steps later (as the batcher plans ahead of its ranks); `constraints`
    (by request name) are ones this rank cannot serve."""
    memory = None
    if blocks:  # the blocks, and the slots' own state beside them (V4's rings and marks)
        probe = loaded.model.new_state(1, block_size, block_size, 1)
        memory = blocks * block_size * probe.bytes_per_token + 6 * probe.fixed_bytes
    settings = Settings(
        model="tiny",
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        decode_batch=4,
        kv_slots_per_rank=6,
        prefill_slots=2,
        mtp=mtp,
        prefix_caching=prefix_caching,
        block_size=block_size,
        kv_cache_memory=memory,
        kv_cache_fraction=0.9 if blocks else 0.0,
    )
    runner = LaunchRunner(loaded.model, settings.launch_shapes())
    assert runner.kv_blocks == blocks and (runner.prefix_cacheable or not prefix_caching)
    rank = LocalRank(runner, loaded.tokenizer, (), MAX_MODEL_LEN)
    config = PlannerConfig(
        1,
        64,
        6,
        4,
        128,
        2,
        pack_prefill=runner.packs,
        prefix_caching=prefix_caching,
        mtp=mtp,
        block_size=block_size,
        paged=bool(blocks),
        max_kv_len=settings.max_kv_len,
    )
    state = PoolState(config)
    join_rank(state, 0, blocks, runner.kv_marks)
    pending = requests if requests is not None else workload(loaded.config.vocab_size)
    tracked: dict[str, Tracked] = {}
    served = Served()
    late: list[StepResult] = []  # results the planner has yet to see

    def queue(name: str, order: int, admission: int) -> None:
        entry = tracked[name]
        context = entry.prompt_ids + entry.resumed_ids
        left = entry.request.sampling.max_tokens - len(entry.resumed_ids)
        seq = Sequence(name, len(context), left, order)
        seq.admission = admission
        seq.block_keys = block_keys(context, config.block_size, "tiny")
        state.waiting.append(seq)

    for step in range(1, 2000):
        for order, (arrival, prompt, sampling) in enumerate(pending):
            name = f"r{order}"
            if arrival <= step and name not in tracked:
                request = GenerateRequest(
                    id=name,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    constraint=(constraints or {}).get(name),
                )
                tracked[name] = Tracked(b"0-1", "s", request, prompt)
                served.tokens[name], served.logprobs[name] = [], []
                queue(name, order, 1)
        if len(tracked) == len(pending) and not (state.waiting or state.running or late):
            return served
        plan = plan_step(state)
        for seq in plan.admitted:
            served.admitted_at.setdefault(seq.request_id, step)
            if seq.num_cached and blocks:
                served.shared += 1
            elif seq.num_cached:
                served.in_place += seq.cached_from == seq.slot
                served.copied += seq.cached_from != seq.slot
        served.most_running = max(served.most_running, len(state.running))
        for rank_plan in rank_plans(plan, tracked, 0, step, settings):
            out = rank.execute(rank_plan)
            for chunk in out.chunks:
                served.tokens[chunk.id] += chunk.token_ids
                served.logprobs[chunk.id] += chunk.logprobs or []
                if chunk.usage is not None:
                    served.cached[chunk.id] = chunk.usage.cached_tokens
                if chunk.error is not None:
                    served.errors[chunk.id] = chunk.error.message
            served.accepted += out.result.counts.num_draft_accepted
            late.append(out.result)
        while len(late) > lag or (late and not plan.admitted and plan.is_empty):
            applied = apply_result(state, late.pop(0))
            for name in applied.released:  # preempted: it resumes after what it published
                served.preempted += 1
                entry = tracked[name]
                entry.resumed_ids = list(served.tokens[name])
                entry.start_seq += 1
                queue(name, int(name[1:]), step + 1)
    raise AssertionError("the requests never finished")


def check_exact(loaded: LoadedModel, mtp: bool, blocks: int = 0) -> None:
    """Hits against misses; in a cache of `blocks` blocks, the hits against misses in
    slots that reserve every position."""
    miss = serve(loaded, prefix_caching=False, mtp=mtp)
    hit = serve(loaded, prefix_caching=True, mtp=mtp, blocks=blocks)
    if blocks:
        assert hit.shared >= 6, hit.shared
    else:
        assert hit.copied >= 3 and hit.in_place >= 3, (hit.copied, hit.in_place)
    assert sum(miss.cached.values()) == 0
    recompute = 1 if mtp else 0

    def resumed(cached: int) -> int:  # unpacked, prefill resumes on a chunk's boundary
        return cached if loaded.model.packs else cached - cached % 128

    assert hit.cached["r1"] == resumed(256 - recompute)  # two blocks, from r0's
    assert hit.cached["r4"] == resumed(255)  # the whole prompt cached: its last token computed
    assert hit.cached["r9"] == 0  # shares nothing
    for name, tokens in miss.tokens.items():
        assert len(tokens) == MAX_TOKENS
        assert hit.tokens[name] == tokens, name
        assert hit.logprobs[name] == miss.logprobs[name], name


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(resolve_model_dir("tiny"), "float32", torch.device("cpu"), MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def tiny_mtp() -> LoadedModel:
    path = resolve_model_dir("tiny")
    return load_model(path, "float32", torch.device("cpu"), MAX_MODEL_LEN, mtp=True)


@pytest.mark.fast
def test_llama_hits_give_the_tokens_and_logprobs_of_misses(tiny: LoadedModel) -> None:
    check_exact(tiny, mtp=False)


@pytest.mark.fast
def test_llama_hits_with_mtp_give_the_tokens_and_logprobs_of_misses(tiny_mtp: LoadedModel) -> None:
    check_exact(tiny_mtp, mtp=True)


@pytest.mark.fast
@pytest.mark.parametrize("mtp", [False, True])
def test_llama_hits_holding_shared_blocks_give_the_tokens_and_logprobs_of_misses(
    tiny: LoadedModel, tiny_mtp: LoadedModel, mtp: bool
) -> None:
    check_exact(tiny_mtp if mtp else tiny, mtp=mtp, blocks=40)


@pytest.mark.fast
def test_a_burst_shares_the_blocks_its_first_request_is_computing(tiny: LoadedModel) -> None:
    """Six requests arrive at once sharing a 300-token prompt; the first carries a
    constraint this rank cannot serve, and the planner sees each step's result two steps
    late, as the batcher planning ahead does. The prompt's blocks are keyed as the step
    computing them is planned, so the other five are admitted to the next step sharing them,
    before the first request's first token is back; the first still computes its prompt,
    then ends with its error. Each of the five gets the tokens and logprobs it gets with
    prefix caching off."""
    rng = random.Random(11)
    vocab = tiny.config.vocab_size
    system = random_prompt(rng, 300, vocab)
    requests = [
        (
            1,
            system + random_prompt(rng, rng.randrange(5, 40), vocab),
            SamplingParams(
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                logprobs=2,
                temperature=0.9 if i % 2 else 0.0,
                seed=50 + i if i % 2 else None,
            ),
        )
        for i in range(6)
    ]
    failing: dict[str, Constraint] = {"r0": Regex(pattern="[a-z]+")}
    options: dict[str, Any] = dict(requests=requests, lag=2, constraints=failing, mtp=False)
    miss = serve(tiny, prefix_caching=False, **options)
    hit = serve(tiny, prefix_caching=True, blocks=40, **options)
    for served in (miss, hit):
        assert "serves no constrained output" in served.errors["r0"]
        assert served.tokens["r0"] == []
    assert hit.shared == 5 and hit.admitted_at == {"r0": 1} | {f"r{i}": 2 for i in range(1, 6)}
    for name in (f"r{i}" for i in range(1, 6)):
        assert hit.cached[name] == 256  # two blocks, computed by r0
        assert len(hit.tokens[name]) == MAX_TOKENS
        assert hit.tokens[name] == miss.tokens[name], name
        assert hit.logprobs[name] == miss.logprobs[name], name


@pytest.mark.parametrize("model", ["llama", "llama-mtp", "v3-mtp", "v4", "v4-mtp"])
def test_requests_preempted_for_blocks_resume_with_the_tokens_of_lone_runs(
    tiny: LoadedModel, tiny_mtp: LoadedModel, deepseek_v3: Path, deepseek_v4: Path, model: str
) -> None:
    """Six requests that together outgrow a cache of 14 blocks of 16 tokens (each alone
    fits): the least urgent give their blocks back and resume later, recomputing what is
    not cached; every token and logprob is what slots reserving every position give
    (DeepSeek-V4's rings start afresh and are computed again): Llama, DeepSeek-V3 and V4."""
    mtp = model.endswith("mtp")
    if model.startswith("v"):
        path = deepseek_v4 if model.startswith("v4") else deepseek_v3
        loaded = load_model(path, "float32", torch.device("cpu"), MAX_MODEL_LEN, mtp=mtp)
    else:
        loaded = tiny_mtp if mtp else tiny
    rng = random.Random(11)
    vocab = loaded.config.vocab_size
    requests = []
    for i in range(6):
        sampled = i % 2 == 1
        sampling = SamplingParams(
            max_tokens=40,
            ignore_eos=True,
            logprobs=2,
            temperature=0.9 if sampled else 0.0,
            seed=500 + i if sampled else None,
        )
        requests.append((1 + i // 3, random_prompt(rng, rng.randrange(18, 40), vocab), sampling))
    alone = serve(loaded, prefix_caching=False, mtp=mtp, requests=requests)
    tight = serve(loaded, True, mtp, blocks=14, block_size=16, requests=requests)
    assert tight.preempted >= 2, tight.preempted
    exact = products_row_count_invariant(loaded.model)
    for name, tokens in alone.tokens.items():
        assert len(tokens) == 40
        assert tight.tokens[name] == tokens, name
        if exact:
            assert tight.logprobs[name] == alone.logprobs[name], name
        else:  # a token decoded then recomputed in a prefill row: equal within rounding
            for got, want in zip(tight.logprobs[name], alone.logprobs[name], strict=True):
                assert got["token_id"] == want["token_id"], name
                assert abs(got["logprob"] - want["logprob"]) < 1e-4, name


def products_row_count_invariant(model: torch.nn.Module) -> bool:
    """Whether this CPU's float32 products give a row the same bits in a decode launch's 4
    rows as in a prefill launch's 128, at every weight matrix's shape of `model` (MKL's are
    on the AMD CPUs CI has run on; on some Intel CPUs they are not, and a resumed token's
    logprobs then agree with its decoded ones within rounding: docs/architecture.md §2)."""
    generator = torch.Generator().manual_seed(0)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    for out, width in shapes:
        weight = torch.randn(out, width, generator=generator)
        rows = torch.randn(128, width, generator=generator)
        if not torch.equal(F.linear(rows[:4], weight), F.linear(rows, weight)[:4]):
            return False
    return True


@pytest.mark.parametrize("model", ["llama", "v4"])
def test_seeded_requests_draw_the_same_tokens_with_mtp_as_without(
    tiny_mtp: LoadedModel, deepseek_v4: Path, model: str
) -> None:
    """A sampled row's token at a draft's place is its own seeded draw, and the draft is
    accepted iff it is that token: so with MTP a seeded request's tokens and logprobs are
    those it draws without (the same model, its MTP module unused). This also needs a
    verify launch's logits to be a decode launch's, bit for bit (the rule itself is
    checked over many seeds in tests/test_mtp.py)."""
    if model == "v4":
        loaded = load_model(deepseek_v4, "float32", torch.device("cpu"), MAX_MODEL_LEN, mtp=True)
    else:
        loaded = tiny_mtp
    rng = random.Random(23)
    vocab = loaded.config.vocab_size
    requests = [
        (
            1 + i // 2,
            random_prompt(rng, rng.randrange(10, 60), vocab),
            SamplingParams(
                max_tokens=30, ignore_eos=True, logprobs=2, temperature=0.7, seed=70 + i
            ),
        )
        for i in range(4)
    ]
    without = serve(loaded, prefix_caching=False, mtp=False, requests=requests)
    drafted = serve(loaded, prefix_caching=False, mtp=True, requests=requests)
    assert drafted.accepted > 0, "no draft was accepted: the comparison shows nothing"
    assert drafted.tokens == without.tokens
    assert drafted.logprobs == without.logprobs


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = pytest.importorskip("npu_worker.weights.makers.deepseek_v3")
    path = tmp_path_factory.mktemp("v3") / "q_lora"
    make.build(path, q_lora=True, mtp=True)
    return path


@pytest.mark.parametrize("mtp", [False, True])
def test_deepseek_v3_hits_give_the_tokens_and_logprobs_of_misses(
    deepseek_v3: Path, mtp: bool
) -> None:
    loaded = load_model(deepseek_v3, "float32", torch.device("cpu"), MAX_MODEL_LEN, mtp=mtp)
    check_exact(loaded, mtp=mtp)
    check_exact(loaded, mtp=mtp, blocks=40)


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small windows (16 positions, compress rates 4 and 16), so the shared prompt crosses
    many of the rings' windows, and an MTP block."""
    make = pytest.importorskip("npu_worker.weights.makers.deepseek_v4")
    path = tmp_path_factory.mktemp("v4") / "small"
    make.build(path, "small", mtp=True)
    return path


@pytest.mark.parametrize("mtp", [False, True])
def test_deepseek_v4_hits_give_the_tokens_and_logprobs_of_misses(
    deepseek_v4: Path, mtp: bool
) -> None:
    """V4's rings are restored from the mark taken where the shared blocks end; misses run
    in slots that reserve every position."""
    loaded = load_model(deepseek_v4, "float32", torch.device("cpu"), MAX_MODEL_LEN, mtp=mtp)
    check_exact(loaded, mtp=mtp, blocks=40)


def test_deepseek_v4_shares_a_prefix_only_in_a_cache_of_blocks(deepseek_v4: Path) -> None:
    """With slots that reserve every position V4 keeps no marks, so it shares no prefix
    (its rank tells the planner so) rather than share one inexactly."""
    loaded = load_model(deepseek_v4, "float32", torch.device("cpu"), MAX_MODEL_LEN)
    state = loaded.model.new_state(2, MAX_MODEL_LEN)
    assert not state.prefix_cacheable and state.num_marks == 0
    with pytest.raises(ValueError, match="only in a cache of blocks"):
        state.copy_prefix(0, 1, 128)
    paged = loaded.model.new_state(2, MAX_MODEL_LEN, 128, 8)
    assert paged.prefix_cacheable and paged.num_marks == 2
