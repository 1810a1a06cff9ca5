#!/usr/bin/env bash
# Issue #54's GPU figures in one run on a CUDA machine that has torch, numpy, scipy, scikit-learn and
# OpenCV but no internet (the device tool's machine). Pure-Python packages travel as wheels in ./wheels
# (made beforehand where a package index is reachable):
#
#     pip download --no-deps -d wheels zennit tqdm
#     bash benchmarks/gpu_floor.sh > gpu_floor.jsonl     # on the GPU machine, from the repository root
#
# torchvision must match the machine's torch (it is not pure Python): if the machine lacks it, download
# the matching wheel into ./wheels too (pip download --no-deps torchvision==<its version>) and install it
# there with `pip install --no-deps wheels/torchvision-*.whl`. Prints one JSON object per figure; the
# benchmark_floor objects hold the host floor, the bench_scale ones the ratios #54 asks for.
set -euo pipefail
wheels=""
if [ -d wheels ]; then wheels=$(find "$PWD/wheels" -name '*.whl' | tr '\n' ':'); fi
export PYTHONPATH="$PWD:${wheels}${PYTHONPATH:-}"
python - <<'PY'
import importlib.util, sys
missing = [m for m in ("torch", "torchvision", "zennit", "tqdm", "cv2", "scipy", "sklearn") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_floor.sh: missing {', '.join(missing)}; put their wheels in ./wheels (see the script's header)")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_floor.sh: no CUDA device here; this script measures the GPU figures of issue #54")
PY
device=${DEVICE:-cuda}
python -m benchmarks.check_devices --family resnet18 --size 64
python -m benchmarks.bench_criteria_cells --device "$device" --images 2048 --batch-size 256
python -m benchmarks.bench_device_batch --device "$device" --runs 3
python -m benchmarks.bench_surprise_device --device "$device" --train 20000 --test 5000 --neurons 256 --runs 2
python -m benchmarks.bench_scale --floor-only --device "$device" --seeds 64 --queries 30 --images 256 --batch-size 64
python -m benchmarks.bench_scale --families resnet18,mobilenet_v3_small --device "$device" --size 224 \
    --images 256 --seeds 64 --queries 30 --batch-size 64
