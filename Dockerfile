# npu-pool images. Two targets:
#   docker build .                      CPU image (the default: the last stage)
#   docker build --target ascend .      Ascend image: CANN base + torch_npu
# Pick the Ascend base whose CANN matches the host's driver, and the torch / torch_npu pair
# that base supports, with --build-arg ASCEND_BASE=... TORCH_SPEC=... TORCH_NPU_SPEC=...
ARG ASCEND_BASE=ascendai/cann:8.0.0-910b-ubuntu22.04-py3.10

FROM ${ASCEND_BASE} AS ascend
ARG TORCH_SPEC="torch==2.5.1"
ARG TORCH_NPU_SPEC="torch_npu==2.5.1"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY npu_pool npu_pool
COPY schemas schemas
COPY producer producer
COPY batcher batcher
COPY npu_worker npu_worker
COPY bench bench
RUN pip install --no-cache-dir "${TORCH_SPEC}" "${TORCH_NPU_SPEC}" \
    && pip install --no-cache-dir ".[all,npu]"
ENV NPUPOOL_DEVICE=npu
CMD ["npu-pool", "up"]

FROM python:3.11-slim AS cpu
# PyPI's torch on Linux is the CUDA build (several GB); pass PyTorch's CPU wheel index as
# --build-arg TORCH_INDEX_URL=... for the small CPU image (compose reads it from the
# environment), or your CUDA version's index.
ARG TORCH_INDEX_URL=""
RUN apt-get update && apt-get install -y --no-install-recommends gcc make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY npu_pool npu_pool
COPY schemas schemas
COPY producer producer
COPY batcher batcher
COPY npu_worker npu_worker
COPY bench bench
RUN pip install --no-cache-dir ".[all]"
CMD ["npu-pool", "up"]
