#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with the wheels that ftsup needs and the GPU machine lacks, for tests/gpu/run.sh to
# install there without a network (docs/gpu.md). Run once here, where pip reaches the package registry.
# The machine's image has Python 3.12, torch, numpy, psutil, pyyaml, prometheus-client, pytest, safetensors and
# huggingface_hub; of ftsup's dependencies only structlog is missing (pure Python; it needs nothing more on 3.12).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
WHEELS=("structlog==26.1.0")
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
ls -l .whl
