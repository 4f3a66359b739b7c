"""The peers `npu-pool bench` measures beside the pool, on the same model and machine:
`transformers` offline and behind RQ (transformers_peers.py, hf_peer.py), and vLLM's CPU
build from its own environment (vllm_*.py, vllm_peer.sh)."""
