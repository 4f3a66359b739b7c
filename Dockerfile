# CPU image of npu-pool. For Ascend, build FROM an image with CANN and torch_npu and
# install the project with its `npu` extra. Pass a CPU-only torch wheel index through
# the PIP_EXTRA_INDEX_URL build argument to keep the image small.
FROM python:3.11-slim
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}
RUN apt-get update && apt-get install -y --no-install-recommends gcc make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY producer producer
COPY batcher batcher
COPY npu_worker npu_worker
RUN pip install --no-cache-dir .
CMD ["npu-pool", "up"]
