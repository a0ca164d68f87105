# syntax=docker/dockerfile:1
#
# tandem's CPU services: gateway, tokenizer and kvstore, plus `tandem fetch-model` for the Helm chart's
# model init container (the `convert` extra). No weights inside: models live on a volume.
#
#   docker build -f docker/cpu.Dockerfile -t tandem:0.1.0 .        (from the repository root)
#   docker run --rm tandem:0.1.0 serve gateway --help
#
# The project is installed like `make run` installs it: torch==2.13.0 first with pip (here the CPU wheel), then
# the project from its pyproject.toml with uv (a regular install, not editable; the replayed build took 52 s where
# pip for both took 114, and uv leaves the image after). tests/e2e/test_docker_images.py runs these RUN
# steps in a fresh virtualenv, so keep them plain pip and uv commands.

ARG PYTHON_VERSION=3.11

# ---- build: a virtualenv with torch (CPU) and the project ---------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build

ENV VIRTUAL_ENV=/opt/tandem \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
ENV PATH=/opt/tandem/bin:$PATH

RUN python -m venv "$VIRTUAL_ENV"

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

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

# Extras: "convert" lets the image run `tandem fetch-model` (transformers, gguf, accelerate);
# --build-arg TANDEM_EXTRAS= builds a slimmer image for the services alone.
ARG TANDEM_EXTRAS=convert
ARG UV_VERSION=0.13.10
RUN pip install "uv==${UV_VERSION}" \
 && uv pip install --compile-bytecode ".${TANDEM_EXTRAS:+[$TANDEM_EXTRAS]}" \
 && pip uninstall -y uv

# ---- runtime: the virtualenv on a clean base, as a non-root user -------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm

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

LABEL org.opencontainers.image.title="tandem" \
      org.opencontainers.image.description="tandem CPU services: gateway, tokenizer, kvstore"

USER ${TANDEM_UID}:${TANDEM_UID}
WORKDIR /home/tandem
# gateway, tokenizer, kvstore gRPC + UCX data plane, metrics (the chart's defaults)
EXPOSE 50051 50052 50071 50072 9090
ENTRYPOINT ["tandem"]
CMD ["--help"]
