# One image for every service; compose.yaml picks the command (gateway, scheduler or worker).
# CPU by default. The CUDA image is this file with two build arguments (compose.gpu.yaml sets them):
#   BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04 TORCH_INDEX_URL=https://pypi.org/simple
# PyPI's torch is its CUDA 13 build, with its own CUDA libraries: the host needs an NVIDIA driver of 580
# or newer and the NVIDIA Container Toolkit (for an older driver: TORCH_INDEX_URL=
# https://download.pytorch.org/whl/cu128, which compose.gpu.yaml takes from PAGEDSERVE_TORCH_INDEX_URL).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# g++: the worker builds its C++ CPU attention kernels on first start (without it: the slower torch path);
# on CUDA, Triton compiles its launcher modules with it and Python's headers.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
COPY services ./services
COPY shared ./shared
COPY protos ./protos
RUN pip install --no-cache-dir -e .
# Built C++ kernels and compiled Triton kernels live on the models volume too, so a restarted worker
# loads them instead of building again (C++ builds are named by source and CPU, so a volume shared
# across machines is safe).
ENV PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/models TORCH_EXTENSIONS_DIR=/models/torch_extensions \
    TRITON_CACHE_DIR=/models/triton_cache
ENTRYPOINT ["pagedserve"]
