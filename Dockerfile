# One image for every service; compose.yaml picks the command (gateway, scheduler or worker).
# CPU build by default; for GPUs build FROM a CUDA PyTorch image and drop the torch pin.
FROM python:3.11-slim
WORKDIR /app
# g++: the worker builds its C++ CPU attention kernels on first start (without it: the slower torch path).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
COPY services ./services
COPY shared ./shared
COPY protos ./protos
RUN pip install --no-cache-dir -e .
# Built C++ kernels live on the models volume too, so a restarted worker loads them instead of
# rebuilding (builds are named by source and CPU, so a volume shared across machines is safe).
ENV PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/models TORCH_EXTENSIONS_DIR=/models/torch_extensions
ENTRYPOINT ["pagedserve"]
