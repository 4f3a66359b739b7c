"""The model a rank serves: a preset (`tiny`, `small`, `smollm2`) or a `.gguf` file made a
model directory once in the cache, or a local directory; then loaded by `loader`."""

from __future__ import annotations

from pathlib import Path

from npu_worker.models.config import UnsupportedModel
from npu_worker.startup import ReportProgress, no_progress
from npu_worker.weights.loader import LoadedModel, load_model
from schemas.config import Settings


def resolve_model_dir(model: str, progress: ReportProgress = no_progress) -> Path:
    """A preset (`tiny`, `small`, `smollm2`) or a `.gguf` file is made a model directory once,
    in the cache; anything else is a local directory."""
    if model in ("tiny", "small"):
        from npu_worker.weights.tiny import ensure_preset

        return ensure_preset(model, progress=progress)
    if model == "smollm2":
        from npu_worker.weights.imported import ensure_smollm2

        return ensure_smollm2(progress=progress)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        from npu_worker.weights.imported import ensure_imported

        return ensure_imported(path, progress=progress)
    if not path.is_dir():
        raise UnsupportedModel(
            f"model directory {path} does not exist (models load from disk only)"
        )
    return path


def load_for(
    settings: Settings,
    progress: ReportProgress = no_progress,
    expert_rank: tuple[int, int] | None = None,
) -> LoadedModel:
    """The configured model on the configured device (CPU threads sized per rank), built
    with the device's layer kit; with `expert_rank` (rank, ranks), this rank's share of the
    experts."""
    from npu_worker.devices import resolve_device, set_cpu_threads
    from npu_worker.kernels import kit_for

    device = resolve_device(settings.device)
    if device.type == "cpu":
        set_cpu_threads(settings.threads_per_rank, settings.ranks)
    rows = max(settings.prefill_chunk, settings.decode_batch * (2 if settings.mtp else 1))
    return load_model(
        resolve_model_dir(settings.model, progress),
        settings.dtype,
        device,
        settings.max_kv_len,
        mtp=settings.mtp,
        expert_rank=expert_rank,
        kit=kit_for(device, settings.decode_kernel, max_rows=rows),
    )
