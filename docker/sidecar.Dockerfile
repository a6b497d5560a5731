# syntax=docker/dockerfile:1
# The sidecar for attached mode: the controller only (no torch, no vLLM), as a non-root user.
# Build from the repository root: docker build -f docker/sidecar.Dockerfile -t vllm-hotswap-sidecar .
FROM python:3.11-slim-bookworm
# checkov:skip=CKV_DOCKER_2:Kubernetes ignores HEALTHCHECK; deploy/k8s probes /livez and /health on the port the pod configures

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md requirements-dev.txt ./
COPY controller ./controller
COPY worker_ext ./worker_ext
# Base dependencies only, held to the versions the tests ran with (a constraints file installs nothing by itself).
RUN pip install --constraint requirements-dev.txt . \
    && python -c "import controller.cli" \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin hotswap

WORKDIR /
USER 10001:10001
EXPOSE 8800 8801
ENTRYPOINT ["hotswap"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8800"]
