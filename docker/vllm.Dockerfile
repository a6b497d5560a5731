# syntax=docker/dockerfile:1
# vLLM with the worker extension installed; in managed mode the same image runs the controller,
# which starts the engines itself (`hotswap serve --config ...`).
# Build from the repository root: docker build -f docker/vllm.Dockerfile -t vllm-hotswap-vllm .
# The tag must agree with the `worker` extra in pyproject.toml (tests/deploy check it).
FROM vllm/vllm-openai:v0.26.0
# checkov:skip=CKV_DOCKER_2:Kubernetes ignores HEALTHCHECK; deploy/k8s probes vLLM (or, managed, the controller) on the ports the pod configures

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
