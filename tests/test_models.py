"""Model loading errors name what is wrong; devices fail clearly; the streaming detokenizer
never splits a character; `npu-pool bench --kernels` measures every launch shape."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch

from npu_worker.devices import resolve_device
from npu_worker.models.config import UnsupportedModel
from npu_worker.output.processor import OutputProcessor
from npu_worker.output.records import StepRecord, TokenRow
from npu_worker.weights.loader import load_model
from npu_worker.weights.tiny import ensure_tiny_model
from schemas.config import Settings
from schemas.control import NewRequest
from schemas.messages import SamplingParams
from tests.helpers import load_reference_model

pytestmark = pytest.mark.fast


def copy_tiny(tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(ensure_tiny_model(), target)
    return target


def edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures ['GPT2LMHeadModel'] (model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
        ({"num_hidden_layers": 3}, "weights missing from the checkpoint"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, "sliding-window"),
    ],
)
def test_an_unsupported_checkpoint_fails_at_load_naming_what_is_wrong(
    tmp_path: Path, change: dict, message: str
) -> None:
    path = copy_tiny(tmp_path)
    edit_config(path, **change)
    with pytest.raises(UnsupportedModel, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_model(path, "auto", torch.device("cpu"), 256)


def test_a_config_without_architectures_loads_by_its_model_type(tmp_path: Path) -> None:
    path = copy_tiny(tmp_path)
    edit_config(path, architectures=None)
    assert load_model(path, "auto", torch.device("cpu"), 256).config.architecture == (
        "LlamaForCausalLM"
    )
    edit_config(path, model_type="gpt2")
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2'"):
        load_model(path, "auto", torch.device("cpu"), 256)


def test_missing_files_are_named(tmp_path: Path) -> None:
    path = copy_tiny(tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedModel, match="no tokenizer.json"):
        load_model(path, "auto", torch.device("cpu"), 256)
    with pytest.raises(UnsupportedModel, match="no config.json"):
        load_model(tmp_path, "auto", torch.device("cpu"), 256)


def test_unavailable_devices_fail_with_what_to_install() -> None:
    with pytest.raises(ValueError, match=r"pip install 'npu-pool\[npu\]'"):
        resolve_device("npu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
        assert resolve_device("auto").type == "cpu"


def test_streamed_text_never_splits_a_multibyte_character() -> None:
    settings = Settings(
        model="tiny", device="cpu", max_model_len=256, decode_batch=2, kv_slots_per_rank=2
    )
    loaded = load_reference_model(settings)
    output = OutputProcessor(loaded.tokenizer)
    text = "Größe 東京 🙂 naïve"
    byte_tokens = []
    for piece, _ in loaded.tokenizer.pre_tokenizer.pre_tokenize_str(text):
        byte_tokens += [loaded.tokenizer.token_to_id(ch) for ch in piece]
    assert None not in byte_tokens and len(byte_tokens) > len(text)
    new = NewRequest(
        request_id="utf8",
        slot=0,
        prompt_token_ids=[5],
        num_prompt_tokens=1,
        sampling=SamplingParams(max_tokens=200),
        result_ttl_s=60,
    )
    record = StepRecord(1, 1, 0, "", new_requests=[new])
    pieces = []
    for token in byte_tokens:
        record.rows = [TokenRow(slot=0, admission=0, token_ids=[token])]
        (chunk,) = output.process(record).chunks
        pieces.append(msgpack.unpackb(chunk.payload)["text"])
        record.new_requests = []
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_kernel_benchmark_reports_every_launch_shape(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "npu_pool.cli",
            "bench",
            "--kernels",
            "--iters",
            "3",
            "--device",
            "cpu",
            "--decode-batch",
            "4",
            "--max-model-len",
            "256",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    shapes = {(row["launch"], row["span"]) for row in result["launches"]}
    assert shapes == {
        ("prefill B1S128", 128),
        ("prefill B1S128", 256),
        ("decode B4S1", 128),
        ("decode B4S1", 256),
    }
    assert result["ceiling"]["tokens_per_s"] > 0 and "ceiling:" in done.stdout
    if result["attention"]:  # the CPU kernels built: their prefill attention timed too
        prefill = result["prefill_attention"]
        assert (prefill["tokens"], prefill["context"]) == (128, 256)
        assert prefill["kernel_ms"] > 0 and "prefill attention, one layer" in done.stdout
