#!/usr/bin/env bash
# Tensor/data parallelism on CUDA, as one command for a machine with NVIDIA GPUs and no
# internet (the device tool's H200 machine: python3 with torch 2.11 + CUDA there).
#   here, once:  bash benchmarks/gpu_parallel_check.sh --download   (wheels into .whl/)
#   there:       bash benchmarks/gpu_parallel_check.sh              (carry .whl)
# The machine lacks these of our dependencies; the rest (aiohttp, jinja2, tokenizers,
# sentencepiece, safetensors, prometheus-client, transformers, numpy) are there.
set -euo pipefail
WHEELS="msgspec==0.23.0 structlog==26.1.0 multiprocess==0.70.19 dill==0.4.1 orjson==3.13.0 gguf==0.19.0 llguidance==1.9.1 pytest-asyncio==1.5.0 py-spy==0.4.3"
if [ "${1:-}" = "--download" ]; then
    grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
    for w in $WHEELS; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any -d .whl "$w"
    done
    exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m benchmarks.gpu_parallel_check
