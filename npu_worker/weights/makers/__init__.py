"""Small random checkpoints written by `transformers` (a test and bench dependency) for the
tests and `npu-pool bench`: DeepSeek-V3 and V4, and the ~3M-parameter Llama vLLM runs."""
