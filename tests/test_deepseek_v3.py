"""DeepSeek-V3 (docs/architecture.md §4a, §8): tiny random checkpoints written by
`transformers` are served with the tokens of `transformers`' own greedy `generate`; split
over two ranks with expert parallelism they give the tokens of one rank; MTP changes no
greedy token and keeps the sampled distribution; an FP8 block-quantized copy loads as its
dequantized weights; bad expert-parallel configurations fail at start, with a reason."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from npu_worker.models.deepseek_v3.model import DeepseekV3CausalLM
from npu_worker.weights.loader import load_model
from producer.client import Client
from producer.status import PoolFailed, collect_status
from schemas.config import Settings
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
)

make = pytest.importorskip("npu_worker.weights.makers.deepseek_v3")
MAX_MODEL_LEN = 512
DTYPE = Settings().dtype  # the pools' (conftest: float32 unless the environment says)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The checkpoints of this file: with q LoRA and an MTP layer, without q LoRA, FP8."""
    root = tmp_path_factory.mktemp("deepseek")
    made = {"q_lora": root / "q_lora", "plain": root / "plain", "fp8": root / "fp8"}
    make.build(made["q_lora"], q_lora=True, mtp=True)
    make.build(made["plain"], q_lora=False)
    make.build(made["fp8"], q_lora=True, fp8=True)
    return made


def lone(path: Path, prompts: list[list[int]], max_tokens: int) -> list[ReferenceCompletion]:
    """Each prompt run alone on one rank holding every expert, no MTP."""
    return lone_runs(path, DTYPE, prompts, max_tokens, MAX_MODEL_LEN)


@pytest.mark.parametrize("kit", list(layer_kits()))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_layer_kit_runs_v3_with_the_tokens_of_a_lone_run(
    kit: str, dtype: str, checkpoints: dict[str, Path]
) -> None:
    """Plain torch layers, the CPU's with its kernels and without them: each serves the
    model, a request's tokens the same whatever shares its launch."""
    path, cpu = checkpoints["q_lora"], torch.device("cpu")
    loaded = load_model(path, dtype, cpu, MAX_MODEL_LEN, kit=layer_kits()[kit]())
    rng = random.Random(27)
    prompts = [random_prompt(rng, n, make.VOCAB_SIZE) for n in (40, 130, 9)]
    shapes = launch_shapes(4, MAX_MODEL_LEN, 128, 4)
    problem = beside_differs(loaded.model, shapes, prompts, TIE_TOLERANCE)
    assert problem is None, f"{kit}, {dtype}: {problem}"


@pytest.mark.parametrize("kind", ["q_lora", "plain"])
def test_greedy_tokens_equal_transformers_generate(
    kind: str, checkpoints: dict[str, Path], start_pool: StartPool, client: Client
) -> None:
    import transformers

    path = checkpoints[kind]
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(path).eval()
    start_pool(model=str(path), ranks=1, decode_batch=4, max_model_len=MAX_MODEL_LEN)
    rng = random.Random(11)
    prompts = [random_prompt(rng, n, make.VOCAB_SIZE) for n in (20, 150, 300)]
    ids = [client.submit(prompt_token_ids=p, max_tokens=48, ignore_eos=True) for p in prompts]
    for request_id, prompt in zip(ids, prompts):
        tokens = check_stream(list(client.stream(request_id, timeout_s=120)))
        problem = first_divergence(tokens, hf_greedy(model, prompt, 48), TIE_TOLERANCE)
        assert problem is None, f"{kind}, prompt of {len(prompt)}: {problem}"


def test_expert_parallel_ranks_serve_48_concurrent_requests_as_one_rank_serves_each_alone(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client, redis_client
) -> None:
    path = checkpoints["q_lora"]
    start_pool(
        model=str(path),
        ranks=2,
        expert_parallel=True,
        decode_batch=8,
        kv_slots_per_rank=24,
        max_model_len=MAX_MODEL_LEN,
    )
    rng = random.Random(12)
    cases = [(random_prompt(rng, rng.randint(3, 200), make.VOCAB_SIZE), 24) for _ in range(48)]
    ids = [client.submit(prompt_token_ids=p, max_tokens=m, ignore_eos=True) for p, m in cases]
    references = lone(path, [p for p, _ in cases], 24)
    for request_id, reference, (prompt, _) in zip(ids, references, cases):
        tokens = check_stream(list(client.stream(request_id, timeout_s=180)))
        problem = first_divergence(tokens, reference, TIE_TOLERANCE)
        assert problem is None, f"prompt of {len(prompt)}: {problem}"
    groups = redis_client.hgetall(Keys().rendezvous("default"))
    assert groups[b"generation"] and groups[b"address"]  # the ranks really formed a group


def test_greedy_with_the_checkpoints_mtp_layer_equals_greedy_without(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client
) -> None:
    path = checkpoints["q_lora"]
    start_pool(
        model=str(path),
        ranks=2,
        expert_parallel=True,
        mtp=True,
        decode_batch=4,
        max_model_len=MAX_MODEL_LEN,
    )
    rng = random.Random(13)
    prompts = [random_prompt(rng, n, make.VOCAB_SIZE) for n in (5, 40, 130, 260)]
    ids = [client.submit(prompt_token_ids=p, max_tokens=40, ignore_eos=True) for p in prompts]
    for request_id, reference in zip(ids, lone(path, prompts, 40)):
        tokens = check_stream(list(client.stream(request_id, timeout_s=180)))
        assert first_divergence(tokens, reference, TIE_TOLERANCE) is None

    def mtp() -> dict:
        return collect_status(client.redis, client.keys)["pools"][0]["mtp"]

    wait_until(lambda: mtp()["proposed"] > 0, what="drafts counted")  # proposed, verified
    counts = mtp()
    print("DeepSeek-V3, its fitted MTP layer:", counts)
    assert 0 < counts["accepted"] < counts["proposed"]  # both the accept and reject paths ran


def test_sampled_tokens_with_the_mtp_layer_follow_the_same_distribution(
    checkpoints: dict[str, Path],
) -> None:
    from tests.test_mtp import chi_square_ok, sample_paths

    path = checkpoints["q_lora"]
    plain = load_model(path, DTYPE, torch.device("cpu"), MAX_MODEL_LEN)
    drafted = load_model(path, DTYPE, torch.device("cpu"), MAX_MODEL_LEN, mtp=True)
    assert chi_square_ok(sample_paths(plain, 800, 0), sample_paths(drafted, 800, 100_000))


def test_an_fp8_copy_loads_as_its_dequantized_weights(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["fp8"]
    stored = load_file(str(path / "model.safetensors"))
    loaded = load_model(path, "float32", torch.device("cpu"), MAX_MODEL_LEN)
    quantized = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    assert len(quantized) > 20
    for name in quantized:
        fp8, scale = stored[name].float(), stored[name + "_scale_inv"]
        want = torch.empty_like(fp8)
        for i in range(scale.shape[0]):  # block by block, as the format defines it
            for j in range(scale.shape[1]):
                rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
                want[rows, cols] = fp8[rows, cols] * scale[i, j]
        layer = loaded.model.get_submodule(name.removesuffix(".weight"))
        assert layer.stored is not None, name  # kept as stored, widened when read
        assert torch.equal(layer.weight.detach(), want), name


def test_a_quantization_format_other_than_fp8_blocks_fails_naming_it(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    from npu_worker.models.config import UnsupportedModel

    path = tmp_path / "int4"
    shutil.copytree(checkpoints["plain"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="quantization 'awq'.* not supported"):
        load_model(path, "auto", torch.device("cpu"), MAX_MODEL_LEN)


def test_an_expert_parallel_rank_reads_only_its_own_experts(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["q_lora"]
    whole = load_model(path, "auto", torch.device("cpu"), MAX_MODEL_LEN)
    half = load_model(path, "auto", torch.device("cpu"), MAX_MODEL_LEN, expert_rank=(1, 2))
    assert isinstance(half.model, DeepseekV3CausalLM)
    moe = half.model.moe_layers()[0]
    assert sorted(int(e) for e in moe.experts) == [4, 5, 6, 7]
    # the bytes held, packed copies included: a packed layer lets go of its plain parameter
    assert half.weight_bytes < whole.weight_bytes


def header_bytes(path: Path, keep) -> int:
    """Bytes of the tensors `keep` accepts, from the safetensors header alone (its JSON:
    each tensor's data offsets), read without torch."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__" and keep(name):
                start, end = entry["data_offsets"]
                total += end - start
    return total


def test_a_rank_counts_the_weight_bytes_it_read_and_holds(checkpoints: dict[str, Path]) -> None:
    """The bytes a rank read are its tensors' in the checkpoint (every expert's but the other
    rank's, MTP's not asked for), and a float32 model holds them at 1:1 within its small
    buffers (rotary tables), as float32 weights need no other copy."""
    path = checkpoints["q_lora"]
    half = load_model(path, "float32", torch.device("cpu"), MAX_MODEL_LEN, expert_rank=(1, 2))

    def kept(name: str) -> bool:
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        mtp_layer = layer == str(
            json.loads((path / "config.json").read_text())["num_hidden_layers"]
        )
        other = any(f".experts.{e}." in name for e in range(4))
        return not (mtp_layer or other)

    assert half.checkpoint_bytes == header_bytes(path, kept)
    assert half.checkpoint_bytes <= half.weight_bytes <= 1.1 * half.checkpoint_bytes


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"model": "tiny"}, "--expert-parallel needs a mixture-of-experts model"),
        ({"ranks": 3}, "8 routed experts do not divide over 3 expert-parallel ranks"),
        ({"missing_expert": True}, "weights missing from the checkpoint"),
    ],
)
def test_a_bad_expert_parallel_configuration_fails_the_pool_with_a_reason(
    overrides: dict,
    reason: str,
    checkpoints: dict[str, Path],
    start_pool: StartPool,
    client: Client,
    tmp_path: Path,
) -> None:
    path = checkpoints["plain"]
    if overrides.pop("missing_expert", False):
        path = without_expert(path, tmp_path / "missing", "model.layers.2.mlp.experts.5.")
    settings = {"model": str(path), "ranks": 2, "expert_parallel": True, **overrides}
    start_pool(wait=False, max_model_len=MAX_MODEL_LEN, **settings)
    with pytest.raises(PoolFailed, match=reason):
        client.wait_ready(timeout_s=120)


def without_expert(path: Path, out: Path, prefix: str) -> Path:
    """A copy of a checkpoint missing one expert's tensors."""
    import shutil

    shutil.copytree(path, out)
    state = load_file(str(out / "model.safetensors"))
    kept = {k: v for k, v in state.items() if not k.startswith(prefix)}
    assert len(kept) < len(state)
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_killing_an_expert_parallel_rank_mid_decode_loses_nothing_and_changes_no_token(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client, redis_client
) -> None:
    path = checkpoints["q_lora"]
    pool = start_pool(
        model=str(path),
        ranks=2,
        expert_parallel=True,
        decode_batch=4,
        kv_slots_per_rank=12,
        max_model_len=MAX_MODEL_LEN,
        rank_timeout_s=3,
        collective_timeout_s=10,
    )
    rng = random.Random(14)
    cases = [(random_prompt(rng, rng.randint(3, 150), make.VOCAB_SIZE), 120) for _ in range(16)]
    ids = [
        client.submit(prompt_token_ids=p, max_tokens=m, ignore_eos=True, request_id=f"k{i}")
        for i, (p, m) in enumerate(cases)
    ]
    keys = Keys()

    def published() -> int:
        pipe = redis_client.pipeline(transaction=False)
        for request_id in ids:
            pipe.xlen(keys.result(request_id))
        return sum(pipe.execute())

    wait_until(lambda: published() > 100, timeout_s=120, what="decode to be under way")
    pool.processes.kill("rank1")
    references = lone(path, [p for p, _ in cases], 120)
    for request_id, reference in zip(ids, references):
        tokens = check_stream(list(client.stream(request_id, timeout_s=240)))
        problem = first_divergence(tokens, reference, TIE_TOLERANCE)
        assert problem is None, f"{request_id}: {problem}"
    assert {c.name: c.restarts for c in pool.processes.children}["rank1"] >= 1
    generation = int(redis_client.hget(keys.rendezvous("default"), "generation"))
    assert generation >= 2  # the group was formed again after the kill
    wait_until(lambda: redis_client.xlen(keys.requests) == 0, what="every entry deleted")
    assert redis_client.xlen(keys.dead) == 0


def test_expert_parallel_prefix_hits_give_the_tokens_and_logprobs_of_misses(
    checkpoints: dict[str, Path], start_pool: StartPool, client: Client
) -> None:
    """Two expert-parallel ranks, the same requests with prefix caching on and off (one pool
    after the other): the hits skip the shared blocks and get the misses' tokens and
    logprobs bit for bit, greedy and seeded sampling alike."""
    path = checkpoints["q_lora"]
    check_prefix_hits_match_misses(
        start_pool,
        client,
        make.VOCAB_SIZE,
        seed=70,
        cached=256,
        model=str(path),
        ranks=2,
        expert_parallel=True,
        decode_batch=4,
        kv_slots_per_rank=8,
        max_model_len=MAX_MODEL_LEN,
    )
