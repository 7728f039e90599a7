#!/usr/bin/env bash
# Issue 4's one device call, prepared: benchmarks/gpu_kernels.py with what the device image lacks.
#
# The device's Python (3.12: torch, triton, transformers, grpcio, protobuf, but no structlog or gRPC
# health/reflection services, and a protobuf and grpcio older than shared/proto's generated code may
# need) cannot reach a registry, so the missing packages travel as wheels. Here, once per checkout:
#     bash benchmarks/gpu_run.sh fetch     # wheels into .whl/ (ignored through .git/info/exclude)
# then one call of the device tool:
#     run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=590)
# or, for the quantized GEMMs (issue 31): run(command="bash benchmarks/gpu_run.sh quant", ...)
# or, for the engine at real size (issue 34: a Llama-3-8B shape in bfloat16, 8 minutes at most):
#     run(command="bash benchmarks/gpu_run.sh real", carry=[".whl"], timeout_s=560)
#   which leaves gpu.txt, gpu_real_size.{log,json} under $OUT.
# It leaves gpu.txt, scheduler_overhead.{log,json}, gpu_kernels.log and gpu_kernels.json under $OUT: the
# issue's five sections, then the decode and prefill tuning sweeps, all within 515 s of this script's
# start; then moe_layer.{log,json} (the fused experts kernel against transformers' loop, about 20 s) by
# 545 s (the call's limit is 590 s; the script's own imports and its report take the rest). The JSON is
# rewritten after every section. On an H200 (2026-12-04, three partial calls) the sections took about
# 48-70 s (check), 12 (decode), 3 (prefill), 8 (cache), 56-84 (engine), 44 (tune), 17-23 (tune_prefill).
set -euo pipefail
START=$(date +%s)
cd "$(dirname "$0")/.."
WHEELS=(structlog==26.1.0 protobuf==7.36.2 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1)

if [[ "${1:-}" == fetch ]]; then
    grep -qsx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    exit
fi

: "${OUT:?run this through the device tool (it sets OUT); use 'fetch' here}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true  # a note, not a step to stop on
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} | tee "$OUT/gpu.txt"
if [[ "${1:-}" == real ]]; then
    # The checkpoint (16 GB) goes to local disk; every section is done by 480 s after this script's start.
    python3 benchmarks/gpu_real_size.py --model-dir /tmp/real-size-model --deadline $((START + 480 - $(date +%s))) \
        --out "$OUT/gpu_real_size.json" 2>&1 | tee "$OUT/gpu_real_size.log"
    exit
fi
# The scheduler's time per step on this host's CPU (about 10 s), beside the GPU's step times below.
python3 benchmarks/scheduler_overhead.py --batch 32 256 --steps 100 --out "$OUT/scheduler_overhead.json" \
    > "$OUT/scheduler_overhead.log" 2>&1 || true
# "quant": issue 31's quantized GEMMs (W4A16 / W8A16, W8A8 int8 and FP8 against bf16) after the checks.
SECTIONS=check,decode,prefill,cache,engine,tune,tune_prefill
[[ "${1:-}" == quant ]] && SECTIONS=check,wna16,w8a8
python3 benchmarks/gpu_kernels.py --sections "$SECTIONS" \
    --deadline $((START + 515 - $(date +%s))) \
    --out "$OUT/gpu_kernels.json" 2>&1 | tee "$OUT/gpu_kernels.log"
# One Qwen3-30B-A3B expert layer (128 experts, 8 per token) in bfloat16: fused kernel, grouped loop, transformers.
timeout $((START + 545 - $(date +%s))) python3 benchmarks/moe_layer.py --device cuda --dtype bfloat16 \
    --hidden 2048 --inter 768 --tokens 1 32 256 2048 --repeats 20 --out "$OUT/moe_layer.json" \
    > "$OUT/moe_layer.log" 2>&1 || true
