#!/usr/bin/env bash
# The CUDA backend's device check (benchmarks/gpu_check.py), one command for a machine with an
# NVIDIA GPU and no internet (the device tool's H200: python3 with torch 2.11 + CUDA, Triton,
# transformers, aiohttp, tokenizers there). About 3.5 minutes on the H200 (2026-12-04; the
# numbers are in docs/performance.md); the decode steps are measured twice, replaying the decode
# graphs and with --enforce-eager, so the two can be compared on the same device. The backend
# tests that need a GPU run first (Triton compiled for the GPU, not its CPU interpreter).
#   here, once:  bash benchmarks/gpu_parallel_check.sh --download   (the same wheels, into .whl/)
#   there:       bash benchmarks/gpu_check.sh                       (carry .whl)
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0
mkdir -p "${OUT:-/tmp/out}"
python3 -m pytest -q -p no:cacheprovider tests/backends/test_backends.py -k cuda 2>&1 | tee "${OUT:-/tmp/out}/pytest.log"
python3 -m benchmarks.gpu_check 2>&1 | tee "${OUT:-/tmp/out}/gpu_check.log"
