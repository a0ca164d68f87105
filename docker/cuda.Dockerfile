# syntax=docker/dockerfile:1
#
# tandem's GPU workers: prefill and decode, with the CUDA build of torch and flash-attn's paged kernels
# (the `cuda` extra). No weights inside: models live on a volume.
#
#   docker build -f docker/cuda.Dockerfile -t tandem-cuda:0.1.0 .        (from the repository root)
#   docker run --rm --gpus all tandem-cuda:0.1.0 serve decode --help
#
# torch 2.13.0's default wheel is built for CUDA 13.0, so the base images are CUDA 13.0 too (the driver must
# support CUDA 13: R580 or newer). flash-attn has no prebuilt wheel for every torch and CUDA pair: it is
# compiled here against the torch above, for the GPU architectures in FLASH_ATTN_CUDA_ARCHS (80: A100,
# 90: H100/H200; add 100 for B200). The compile needs several GB of RAM per job: lower MAX_JOBS if the build
# runs out of memory.

ARG CUDA_VERSION=13.0.1
ARG UBUNTU_VERSION=24.04

# ---- build: a virtualenv with CUDA torch, flash-attn and the project ----------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ninja-build \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/tandem \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
ENV PATH=/opt/tandem/bin:$PATH

RUN python3 -m venv "$VIRTUAL_ENV"

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=8
ARG NVCC_THREADS=2
RUN pip install ninja packaging psutil einops wheel "setuptools>=68" \
 && FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" NVCC_THREADS="${NVCC_THREADS}" \
    pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"

WORKDIR /src
COPY pyproject.toml ./
COPY protos ./protos
COPY common ./common
COPY engine ./engine
COPY tandem ./tandem
COPY kvstore ./kvstore
COPY gateway ./gateway
COPY tokenizer_svc ./tokenizer_svc
COPY prefill_svc ./prefill_svc
COPY decode_svc ./decode_svc

ARG TANDEM_EXTRAS=cuda
ARG UV_VERSION=0.13.10
RUN pip install "uv==${UV_VERSION}" \
 && uv pip install --compile-bytecode ".${TANDEM_EXTRAS:+[$TANDEM_EXTRAS]}" \
 && pip uninstall -y uv

# ---- runtime: the virtualenv on the CUDA runtime base, as a non-root user ------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}

ARG DEBIAN_FRONTEND=noninteractive
# The interpreter the virtualenv was made with (same Ubuntu release, same path).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/*

ARG TANDEM_UID=10001
RUN groupadd --system --gid "${TANDEM_UID}" tandem \
 && useradd --system --uid "${TANDEM_UID}" --gid tandem --home-dir /home/tandem --create-home \
        --shell /usr/sbin/nologin tandem

COPY --from=build /opt/tandem /opt/tandem

ENV VIRTUAL_ENV=/opt/tandem \
    PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/tandem \
    TANDEM_HOME=/home/tandem/.cache/tandem

LABEL org.opencontainers.image.title="tandem-cuda" \
      org.opencontainers.image.description="tandem GPU workers: prefill and decode (CUDA torch, flash-attn)"

USER ${TANDEM_UID}:${TANDEM_UID}
WORKDIR /home/tandem
# prefill, decode gRPC, metrics (the chart's defaults)
EXPOSE 50061 50062 9090
ENTRYPOINT ["tandem"]
CMD ["--help"]
