"""The vLLM environment of `npu-pool bench --vllm-python`: checking it before the run, and
the model, dtype and process environment vLLM gets.

vLLM lives only in its own environment (`bench/peers/vllm_peer.sh` builds one); the project runs
that environment's Python and never imports vLLM.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from schemas.config import Settings

PROBE_TIMEOUT_S = 300.0
# `transformers` is imported as vLLM will: with CUDA builds of torchvision and friends next to
# the CPU torch, importing a model class fails, and vLLM's engine with it.
PROBE = (
    "import json, sys, torch, vllm\n"
    "from transformers import LlamaForCausalLM\n"
    "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__,"
    " 'prefix': sys.prefix}))"
)
BUILD_HINT = "build an environment that can with `bash bench/peers/vllm_peer.sh`"
KV_CACHE_GIB = 1  # vLLM's CPU KV cache: 1 GiB holds 262,144 tokens of the 3M checkpoint


class VllmUnavailable(ValueError):
    """The vLLM peer cannot run as asked, with what was wrong."""


@dataclass(frozen=True, slots=True)
class VllmPeer:
    """A Python that runs vLLM, what it runs, and the environment vLLM's processes get."""

    python: str
    vllm_version: str
    torch_version: str
    model_dir: Path
    dtype: str
    threads: int
    env_settings: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """This process's environment with the vLLM settings on top."""
        return os.environ | self.env_settings

    def describe(self) -> dict[str, object]:
        """Versions and settings, for the report."""
        return {
            "vllm_version": self.vllm_version,
            "torch_version": self.torch_version,
            "python": self.python,
            "model": str(self.model_dir),
            "dtype": self.dtype,
            "model_threads": self.threads,
            "env": dict(self.env_settings),
        }


def check_vllm_peer(
    python: str, settings: Settings, threads: int, dtype: str | None = None
) -> VllmPeer:
    """The peer for `--vllm-python` at `dtype` (None: the pool's), or VllmUnavailable saying
    why it cannot run."""
    model_dir = _model_dir(settings.model)
    dtype = _vllm_dtype(dtype or settings.dtype, model_dir)
    exe = Path(python).expanduser()
    if not exe.is_file() or not os.access(exe, os.X_OK):
        raise VllmUnavailable(f"--vllm-python {python}: no such executable; {BUILD_HINT}")
    try:
        done = subprocess.run(
            [str(exe), "-P", "-c", PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise VllmUnavailable(
            f"--vllm-python {python} did not import vllm within {PROBE_TIMEOUT_S:.0f} s"
        ) from exc
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        raise VllmUnavailable(f"--vllm-python {python} cannot run vLLM ({lines[-1]}); {BUILD_HINT}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    env_settings = _env_settings(threads, Path(info["prefix"]))
    return VllmPeer(str(exe), info["vllm"], info["torch"], model_dir, dtype, threads, env_settings)


def _model_dir(model: str) -> Path:
    """vLLM reads a Hugging Face directory; the pool's presets and .gguf files it cannot."""
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise VllmUnavailable(
            f"--vllm-python needs --model DIR, a Hugging Face model directory vLLM can read "
            f"(such as the one `bash bench/peers/vllm_peer.sh` writes), not {model!r}"
        )
    return path.resolve()


def _vllm_dtype(dtype: str, model_dir: Path) -> str:
    """The dtype the pool's rank runs at (`auto`: the checkpoint's, bfloat16 for float32 on a
    CPU where the pool runs bfloat16 faster), named for vLLM."""
    if dtype == "auto":
        config = json.loads((model_dir / "config.json").read_text())
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        from npu_worker.devices import cpu_prefers_bf16  # torch: not for `--help`

        if dtype == "float32" and cpu_prefers_bf16():
            dtype = "bfloat16"
    if dtype == "float16":  # the pool's CPU ranks run float16 checkpoints in bfloat16
        return "bfloat16"
    if dtype not in ("float32", "bfloat16"):
        raise VllmUnavailable(f"vLLM's CPU build cannot run dtype {dtype}; use --dtype float32")
    return dtype


def _env_settings(threads: int, prefix: Path) -> dict[str, str]:
    """vLLM CPU's knobs for `threads` model threads, as a pool rank gets."""
    cores = sorted(os.sched_getaffinity(0))[-threads:]
    settings = {
        # The CPU worker binds one OpenMP thread to each listed core: `threads` model threads.
        # The last cores, as vLLM's own "auto" picks them, leaving the first to its
        # scheduler, front end and the load generator.
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(core) for core in cores),
        # torch threads of vLLM's front-end and engine-core processes
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
    }
    # vLLM's CPU guide preloads tcmalloc and Intel's OpenMP (the `intel-openmp` wheel it
    # depends on); it warns without them, and they were a few percent faster here.
    preload = [
        str(lib)
        for lib in (ctypes.util.find_library("tcmalloc_minimal"), prefix / "lib" / "libiomp5.so")
        if lib and (not isinstance(lib, Path) or lib.is_file())
    ]
    if preload:
        settings["LD_PRELOAD"] = ":".join(preload)
    return settings
