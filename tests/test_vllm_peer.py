"""The vLLM peer of `npu-pool bench` without vLLM: the 3M Llama checkpoint it runs on, the
checks that stop a run that could not reach vLLM, and how its figures are reported."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench import serve as bench
from npu_worker.weights.tiny import ensure_tiny_model
from producer.client import Client
from tests.helpers import TIE_TOLERANCE, check_stream, random_prompt
from tests.reference import first_divergence, hf_greedy

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def make_llama3m(out: Path) -> Path:
    """Run the checkpoint builder as `bench/peers/vllm_peer.sh` does."""
    subprocess.run(
        [sys.executable, "-m", "npu_worker.weights.makers.llama3m", str(out)],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="module")
def llama3m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama3m(tmp_path_factory.mktemp("llama3m") / "llama3m")


def test_llama3m_builder_writes_the_same_3m_parameter_checkpoint_every_time(
    llama3m: Path, tmp_path: Path
) -> None:
    again = make_llama3m(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (llama3m / name).read_bytes(), name
    assert (llama3m / "tokenizer.json").read_bytes() == (
        ensure_tiny_model() / "tokenizer.json"
    ).read_bytes()
    config = json.loads((llama3m / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        256,
        4,
        512,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(llama3m)
    assert sum(p.numel() for p in model.parameters()) == 3_016_960


def test_llama3m_builder_refuses_to_overwrite_a_checkpoint(llama3m: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "npu_worker.weights.makers.llama3m", str(llama3m)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert f"{llama3m} already holds a checkpoint" in done.stderr


def test_pool_serves_llama3m_with_the_greedy_tokens_of_transformers(
    llama3m: Path, start_pool, client: Client
) -> None:
    start_pool(model=str(llama3m), ranks=1, decode_batch=8, max_model_len=256)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama3m).eval()
    rng = random.Random(12)
    cases = [(random_prompt(rng, n, 512), 64) for n in (16, 41, 96, 70)]
    ids = [client.submit(prompt_token_ids=p, max_tokens=m, ignore_eos=True) for p, m in cases]
    for request_id, (prompt, max_tokens) in zip(ids, cases):
        tokens = check_stream(list(client.stream(request_id, timeout_s=120)))
        problem = first_divergence(tokens, hf_greedy(model, prompt, max_tokens), TIE_TOLERANCE)
        assert problem is None, f"prompt of {len(prompt)}: {problem}"


def test_bench_with_a_python_lacking_vllm_stops_before_the_pool_saying_what_to_build(
    llama3m: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench.main(["--model", str(llama3m), "--vllm-python", sys.executable, "--no-peers"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--vllm-python {sys.executable} cannot run vLLM (ModuleNotFoundError: " in err
    assert "No module named 'vllm'" in err
    assert "bash bench/peers/vllm_peer.sh" in err


def test_bench_vllm_peer_needs_an_executable_and_a_model_directory(
    llama3m: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-python"
    assert bench.main(["--model", str(llama3m), "--vllm-python", str(missing)]) == 2
    assert f"--vllm-python {missing}: no such executable" in capsys.readouterr().err
    assert bench.main(["--model", "tiny", "--vllm-python", sys.executable]) == 2
    assert "--vllm-python needs --model DIR" in capsys.readouterr().err
    assert bench.main(["--model", str(llama3m), "--dtype", "float64", "--vllm-python", "x"]) == 2
    assert "vLLM's CPU build cannot run dtype float64" in capsys.readouterr().err


def _level(concurrency: int, tokens_per_s: float) -> dict[str, object]:
    ms = {"p50": 10.0, "p90": 20.0, "p99": 30.0}
    return {
        "concurrency": concurrency,
        "output_tokens_per_s": tokens_per_s,
        "requests_per_s": 1.0,
        "ttft_ms": ms,
        "tpot_ms": ms,
        "itl_ms": ms,
        "e2e_ms": ms,
        "goodput_requests_per_s": 1.0,
        "padding_waste": 0.0,
        "workload_ceiling": {"output_tokens_per_s": 2500.0},
    }


def test_report_compares_the_pool_at_64_with_vllm_offline_and_its_server_at_64(
    capsys: pytest.CaptureFixture[str],
) -> None:
    peer = {
        "vllm_version": "0.32.0",
        "torch_version": "2.13.0+cpu",
        "dtype": "float32",
        "model_threads": 1,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "1", "LD_PRELOAD": "libtcmalloc_minimal.so.4"},
    }
    report = {
        "levels": [_level(1, 200.0), _level(64, 1500.0), _level(128, 1800.0)],
        "ceiling": {"output_tokens_per_s": 3000.0},
        "planner_us_per_step": 50.0,
        "vllm_offline": peer
        | {
            "concurrency": 64,
            "requests": 192,
            "engine": {"max_num_seqs": 64},
            "wall_s": 4.0,
            "output_tokens_per_s": 3000.0,
            "decode_tokens_per_s": 6000.0,
        },
        "vllm_http": peer
        | {
            "levels": [_level(1, 400.0), _level(64, 2000.0)],
            "burst": {"requests": 64, "ttft_ms": {"p50": 100.0, "p90": 150.0, "p99": 200.0}},
        },
        "burst": {
            "requests": 64,
            "ttft_ms": {"p50": 150.0, "p90": 250.0, "p99": 300.0},
            "itl_ms": {"p50": 15.0, "p90": 20.0, "p99": 150.0},
            "prefill_efficiency": 0.95,
            "prefill_launches_per_request": 0.5,
            "prefill_bound_ideal_ms": 250.0,
            "ttft_p99_over_ideal": 1.2,
        },
    }
    report["ratios"] = bench.ratios(report)
    assert report["ratios"] == {
        "pool_over_ceiling": 0.6,
        "pool_over_workload_ceiling": 0.72,
        "burst_ttft_p99_over_ideal": 1.2,
        "burst_ttft_p99_over_vllm_http": 1.5,
        "pool_over_vllm_offline": 0.5,
        "ceiling_over_vllm_offline_decode": 0.5,
        "pool_over_vllm_http": 0.75,
    }
    bench.print_report(report)
    out = capsys.readouterr().out
    assert "vLLM 0.32.0 (torch 2.13.0+cpu), float32, 1 model thread(s): " in out
    assert "VLLM_CPU_OMP_THREADS_BIND=1" in out
    assert "vllm offline: 3000 tokens/s whole workload (192 requests, at most 64" in out
    assert "6000 tokens/s decode alone" in out
    assert "vllm http   64:     2000 tokens/s" in out
    assert "pool_over_vllm_http: 0.75x" in out
    assert "vllm http burst of 64: TTFT p50 100 / p90 150 / p99 200 ms" in out
    assert "burst_ttft_p99_over_vllm_http: 1.50x" in out
