#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on the device machine: install the carried wheels (.whl/, made here by
# `make gpu-check-wheels`) beside the image's CUDA torch and transformers, then run the check with the
# generated stubs (common/pb/tpserve, carried). Figures go to $OUT/gpu-check.json (or ./gpu-check.json).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
exec python3 -m bench.gpu_check --device cuda --dtype bfloat16 --out "${OUT:-.}/gpu-check.json" "$@"
