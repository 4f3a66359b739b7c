"""MTP K=1 (docs/architecture.md §4): acceptance, the committed window, greedy equality with plain
decoding through the pool, and the same sampled distribution."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from npu_worker.models.launch import LaunchInputs
from npu_worker.mtp import accept_drafts
from npu_worker.runner import LaunchRunner
from npu_worker.sampler import sample, sampling_rows
from npu_worker.weights.loader import LoadedModel, load_model
from npu_worker.weights.presets import resolve_model_dir
from producer.client import Client
from schemas.config import Settings
from schemas.control import NewRequest, PrefillChunk, RankStepPlan, StepResult
from schemas.keys import Keys
from schemas.messages import SamplingParams
from tests.helpers import TIE_TOLERANCE, LocalRank, check_stream, random_prompt
from tests.reference import first_divergence, generate_alone, launch_shapes

SETTINGS = Settings(
    model="tiny", device="cpu", max_model_len=512, decode_batch=4, kv_slots_per_rank=8
)


def load(mtp: bool) -> LoadedModel:
    return load_model(
        resolve_model_dir("tiny"), SETTINGS.dtype, torch.device("cpu"), SETTINGS.max_kv_len, mtp=mtp
    )


@pytest.fixture(scope="module")
def with_mtp() -> LoadedModel:
    return load(mtp=True)


def greedy_rows(n: int) -> object:
    return sampling_rows([SamplingParams()] * n, [0] * n, [0] * n, torch.device("cpu"))


@pytest.mark.fast
def test_greedy_acceptance_commits_the_draft_and_the_bonus_or_the_correction() -> None:
    logits = torch.full((2, 2, 5), -1.0)
    logits[0, 0, 3], logits[0, 1, 4] = 2.0, 2.0  # row 0: argmax 3 then 4
    logits[1, 0, 1], logits[1, 1, 2] = 2.0, 2.0  # row 1: argmax 1 then 2
    decided = accept_drafts(logits, torch.tensor([3, 0]), greedy_rows(2))
    assert decided.accepted.tolist() == [True, False]
    assert decided.first.tolist() == [3, 1]  # the draft, or the argmax correcting it
    assert decided.second.tolist()[0] == 4  # the bonus after an accepted draft


@pytest.mark.fast
def test_sampled_acceptance_is_certain_at_p_one_and_impossible_at_p_zero() -> None:
    logits = torch.full((2, 2, 4), -1e9)
    logits[0, :, 2] = 0.0  # row 0: all mass on token 2; the draft is 2
    logits[1, 0, 1], logits[1, 0, 3], logits[1, 1, 0] = 0.0, 0.0, 0.0  # row 1: draft 2 has p=0
    rows = sampling_rows(
        [SamplingParams(temperature=1.0, seed=5)] * 2, [5, 6], [3, 3], torch.device("cpu")
    )
    decided = accept_drafts(logits, torch.tensor([2, 2]), rows)
    assert decided.accepted.tolist() == [True, False]
    assert decided.first[0] == 2 and decided.first[1] in (1, 3)


@pytest.mark.fast
@pytest.mark.parametrize("which", ["likely", "unlikely"])
def test_a_sampled_row_commits_its_own_draw_whatever_the_draft(which: str) -> None:
    """Over 4,000 seeds, each row commits at the draft's place the token its seeded draw
    picks without a draft (so a seeded request's tokens do not depend on its drafts), and
    accepts the draft exactly when it is that token: about p(draft) of the time."""
    n = 4000
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 2, 6, generator=generator).expand(n, -1, -1).contiguous()
    probs = torch.softmax(logits[0, 0], dim=-1)
    draft = int(probs.argmax()) if which == "likely" else int(probs.argmin())
    rows = sampling_rows(
        [SamplingParams(temperature=1.0, seed=s) for s in range(n)],
        list(range(n)),
        [5] * n,
        torch.device("cpu"),
    )
    decided = accept_drafts(logits, torch.full((n,), draft), rows)
    own = sample(logits[:, 0], rows)
    assert torch.equal(decided.first, own)
    assert torch.equal(decided.accepted, own == draft)
    p = float(probs[draft])
    rate = float(decided.accepted.double().mean())
    assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / n), (rate, p)


def committed(runner: LaunchRunner, slot: int) -> tuple[int, int, int]:
    tail = runner.tail
    return int(tail.token[slot]), int(tail.position[slot]), int(tail.draft[slot])


@pytest.mark.fast
def test_committed_window_after_acceptance_and_rejection(with_mtp: LoadedModel) -> None:
    runner = LaunchRunner(with_mtp.model, launch_shapes(8, SETTINGS.max_kv_len, 128, 4))
    prompt = random_prompt(random.Random(1), 20, 512)
    for slot in (2, 3):
        chunks = [PrefillChunk(slot=slot, start=0, num_tokens=len(prompt))]
        out = runner.prefill(chunks, [prompt])
        runner.draft_prefill(chunks, out.hidden, [prompt[1:] + [7]])
        runner.set_tail(slot, 7, 20, 9)
    verify = runner.verify([2, 3], max_position=20)
    assert verify.drafts.tolist() == [9, 9] and verify.positions.tolist() == [20, 20]
    first, second = torch.tensor([9, 11]), torch.tensor([13, 15])
    accepted = torch.tensor([True, False])
    drafts = runner.commit(verify, first, second, accepted)
    assert committed(runner, 2) == (13, 22, int(drafts[0]))  # 7, 9 and 13 committed
    assert committed(runner, 3) == (11, 21, int(drafts[1]))  # 7 and the correction 11
    # The new drafts are the MTP module's argmax on exactly those inputs:
    scratch = runner.state.scratch_position
    hidden = verify.hidden
    rows = [verify.layout.rows[0], verify.layout.rows[1]]
    expected = []
    for row, (ids, positions, index) in zip(
        rows, [([9, 13], [20, 21], 1), ([11, 0], [20, scratch], 0)]
    ):
        launch = LaunchInputs(
            torch.tensor([ids]),
            torch.tensor([positions]),
            torch.tensor([verify.layout.slot_ids[row]]),
            torch.tensor([[index]]),
            verify.span,
            None,
        )
        expected.append(
            int(with_mtp.model.draft(launch, hidden[row : row + 1], runner.state).argmax())
        )
    assert drafts.tolist() == expected


def test_greedy_with_mtp_equals_greedy_without_over_three_microbatches_per_rank(
    start_pool, client: Client, redis_client
) -> None:
    settings = start_pool(
        mtp=True, ranks=2, decode_batch=4, max_num_seqs=24, kv_slots_per_rank=12, max_model_len=512
    ).settings
    plain = load(mtp=False)
    runner = LaunchRunner(plain.model, launch_shapes(12, settings.max_kv_len, 128, 4))
    rng = random.Random(11)
    texts = ["Once upon a time", "Hello, world!", "The pool reads requests", "def add(a, b):"]
    cases = []
    for i in range(48):
        prompt = (
            plain.tokenizer.encode(texts[i % 4]).ids
            if i % 3
            else random_prompt(rng, rng.randrange(1, 260), 512)
        )
        cases.append((prompt, rng.randrange(20, 70)))
    ids = [client.submit(prompt_token_ids=p, max_tokens=m, ignore_eos=True) for p, m in cases]
    for request_id, (prompt, max_tokens) in zip(ids, cases):
        tokens = check_stream(list(client.stream(request_id, timeout_s=180)))
        want = generate_alone(runner, prompt, max_tokens, set(), settings.max_model_len)
        problem = first_divergence(tokens, want, TIE_TOLERANCE)
        assert problem is None, f"{request_id}: {problem}"
    steps = [
        StepResult.decode(f[b"m"])
        for _, f in redis_client.xrange(Keys().step_results(settings.pool))
    ]
    proposed = sum(s.counts.num_draft_proposed for s in steps)
    accepted = sum(s.counts.num_draft_accepted for s in steps)
    assert 0 < accepted < proposed  # both the accept and the reject paths ran
    assert max(s.counts.num_decode_launches for s in steps) == 3  # 12 rows per rank, B4


def sample_paths(loaded: LoadedModel, count: int, seed_base: int) -> Counter:
    """(token 1, token 2) of `count` sampled completions of one prompt, 8 at a time."""
    runner = LaunchRunner(loaded.model, launch_shapes(8, SETTINGS.max_kv_len, 128, 8))
    engine = LocalRank(runner, loaded.tokenizer, (), SETTINGS.max_model_len)
    sampling = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    prompt = [12, 13, 14, 15]
    paths: Counter = Counter()
    step = 0
    for batch in range(count // 8):
        news = [
            NewRequest(
                request_id=f"s{batch}-{i}",
                slot=i,
                prompt_token_ids=prompt,
                num_prompt_tokens=4,
                result_ttl_s=60,
                sampling=sampling.model_copy(update={"seed": seed_base + batch * 8 + i}),
            )
            for i in range(8)
        ]
        tokens: dict[str, list[int]] = {n.request_id: [] for n in news}
        step += 1
        plan = RankStepPlan(
            epoch=1,
            step=step,
            rank=0,
            new_requests=news,
            prefill=[[PrefillChunk(slot=i, start=0, num_tokens=4)] for i in range(8)],
        )
        while True:
            for chunk in engine.execute(plan).chunks:
                tokens[chunk.id] += chunk.token_ids
            if not engine.busy_slots:
                break
            step += 1
            plan = RankStepPlan(epoch=1, step=step, rank=0, decode_launches=[engine.busy_slots])
        paths.update(tuple(t[1:3]) for t in tokens.values())
    return paths


def chi_square_ok(plain: Counter, drafted: Counter) -> bool:
    """Whether two samples of paths could come from one distribution (chi-square test of
    homogeneity at alpha = 0.001, over the paths seen at least 10 times)."""
    keys = [k for k in set(plain) | set(drafted) if plain[k] + drafted[k] >= 10]
    chi2 = sum((plain[k] - drafted[k]) ** 2 / (plain[k] + drafted[k]) for k in keys)
    df = len(keys) - 1
    # chi-square critical value at alpha = 0.001 (Wilson-Hilferty approximation)
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert df >= 2, (plain, drafted)
    return chi2 < critical


@pytest.mark.fast
def test_sampled_tokens_with_mtp_follow_the_same_distribution(with_mtp: LoadedModel) -> None:
    count = 800
    plain = sample_paths(load(mtp=False), count, seed_base=0)
    drafted = sample_paths(with_mtp, count, seed_base=100_000)
    assert chi_square_ok(plain, drafted), (plain, drafted)


@pytest.mark.fast
@pytest.mark.parametrize(("prompt_len", "max_tokens", "expected"), [(150, 50, 10), (5, 7, 7)])
def test_mtp_never_overruns_max_model_len_or_max_tokens(
    with_mtp: LoadedModel, prompt_len: int, max_tokens: int, expected: int
) -> None:
    runner = LaunchRunner(with_mtp.model, launch_shapes(8, 256, 128, 4))
    engine = LocalRank(runner, with_mtp.tokenizer, (), max_model_len=160)
    prompt = random_prompt(random.Random(prompt_len), prompt_len, 512)
    new = NewRequest(
        request_id="edge",
        slot=0,
        prompt_token_ids=prompt,
        num_prompt_tokens=prompt_len,
        result_ttl_s=60,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    chunks = [
        PrefillChunk(slot=0, start=s, num_tokens=min(128, prompt_len - s))
        for s in range(0, prompt_len, 128)
    ]
    plans = [RankStepPlan(epoch=1, step=1, rank=0, new_requests=[new], prefill=[chunks[:1]])]
    plans += [
        RankStepPlan(epoch=1, step=2 + i, rank=0, prefill=[[c]]) for i, c in enumerate(chunks[1:])
    ]
    tokens: list[int] = []
    finals = []
    for plan in plans:
        for chunk in engine.execute(plan).chunks:
            tokens += chunk.token_ids
            finals.append(chunk.finish_reason)
    step = 10
    while engine.busy_slots:
        for chunk in engine.execute(
            RankStepPlan(epoch=1, step=step, rank=0, decode_launches=[[0]])
        ).chunks:
            tokens += chunk.token_ids
            finals.append(chunk.finish_reason)
        step += 1
    assert len(tokens) == expected and finals[-1] == "length"
