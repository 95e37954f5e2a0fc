# Flotilla's image: `flotilla` (gateway, router, worker, keys, ...) and `kopf` (the operator) from the wheel,
# in a virtualenv at /opt/flotilla, run as uid 10001 on a read-only root filesystem.
#
#   make image                          # CPU: torch from download.pytorch.org/whl/cpu, gcc for the decode kernel
#   make image TORCH_VARIANT=cu128      # CUDA 12.8: torch's CUDA wheels carry the CUDA runtime; the node
#                                       # supplies the driver (NVIDIA device plugin / container toolkit)
#
# Writable paths at run time: /tmp and /var/cache/flotilla (the CPU decode kernel, compiled on first use for
# the node's CPU with -march=native, so not at build time; Hugging Face and Triton caches: Triton compiles the
# GPU attention kernels on first use). The chart mounts
# emptyDirs there. tests/packaging/test_image_install.py runs this file's venv, wheel and install commands.
ARG PYTHON_IMAGE=docker.io/library/python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/flotilla/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/flotilla
# The exact pins (requirements.txt), torch from the variant's index; nothing of the source tree yet, so this
# layer is rebuilt only when the pins change.
COPY requirements.txt ./
RUN pip install --no-cache-dir --extra-index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        --requirement requirements.txt
COPY pyproject.toml setup.py ./
COPY protos protos
COPY libs libs
COPY services services
COPY operators operators
# The wheel (setup.py generates the gRPC stubs from protos/), then the wheel alone into the venv: the image
# holds the distribution, not the source tree.
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /tmp/dist . \
    && pip install --no-cache-dir --no-deps --no-index /tmp/dist/flotilla-*.whl

FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="flotilla" \
      org.opencontainers.image.description="Flotilla LLM-serving fleet: gateway, router, workers, operator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/flotilla/flotilla" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.13-slim-bookworm" \
      dev.flotilla.torch-variant="${TORCH_VARIANT}"
# Every image carries a C compiler: on a CPU the decode kernel is built for the node's CPU on first use, on CUDA
# Triton builds its launcher stubs with it (the attention kernels themselves go through Triton's bundled ptxas).
# Debian's versions are not pinned: bookworm's point releases replace them and an old pin stops resolving; the
# base image tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 flotilla \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/flotilla --create-home flotilla \
    && install -d -o 10001 -g 10001 /var/cache/flotilla
COPY --from=build /opt/flotilla /opt/flotilla
ENV PATH=/opt/flotilla/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FLOTILLA_CACHE=/var/cache/flotilla \
    XDG_CACHE_HOME=/var/cache/flotilla \
    HF_HOME=/var/cache/flotilla/huggingface \
    TRITON_CACHE_DIR=/var/cache/flotilla/triton
USER 10001:10001
WORKDIR /home/flotilla
ENTRYPOINT ["flotilla"]
CMD ["--help"]
