"""Model architectures (one file per family), their shared layers, and the model store:
loading, presets, the tiny models and GGUF import (docs/architecture.md §8)."""
