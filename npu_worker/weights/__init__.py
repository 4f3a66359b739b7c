"""The weight store: loading a model directory (loader.py, checkpoint.py), presets and the
models made on first use (presets.py, tiny.py, tiny_mtp.py, imported.py), GGUF import
(gguf/), `npu-pool models` (cli.py), and the checkpoint makers tests and benchmarks build
their DeepSeek and Llama checkpoints with (makers/)."""
