#!/usr/bin/env bash
# The GPU verification (issue 3, and every CUDA path since: streaming, layered, distributed over NCCL), as one script.
#
# Here (a machine with PyPI), once:   benchmarks/gpu_check.sh prepare
#   downloads the peers' wheels for the device image's Python 3.12 into .whl/ (git-ignored).
# On the lent H200 (device tool: carry [".whl"], timeout about 540 s):   benchmarks/gpu_check.sh run
#   installs the wheels, runs every CUDA test (the node cache's GPU tier among them), the device-window check
#   (benchmarks/device_window.py), the cache's GPU bench (benchmarks/cache_gpu_bench.py), then `bench --device cuda` on an 8 GiB demo
#   checkpoint, warm and cold (weightstream, weightstream-layered, ...), against safetensors, runai-model-streamer, fastsafetensors
#   (nogds and GDS) and InstantTensor, with the pinned host-to-device limit.
# Results land in $OUT (tests.log, device-window.json, cache-gpu-2gib.json, bench-cuda-8gib-{warm,cold}.json, bench.log).
set -uo pipefail
cd "$(dirname "$0")/.."

PEERS=(fastsafetensors==0.5.0 runai-model-streamer==0.17.1 instanttensor==0.2.2 humanize==4.12.3 typer==0.16.0)

prepare() {
    grep -qxF /.whl/ .git/info/exclude || echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${PEERS[@]}"
    ls -la .whl
}

run() {
    : "${OUT:=/tmp/gpu-check-out}"; mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/machine.txt"
    python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, torch.version.cuda, 'cuda-bindings', cuda.bindings.__version__)" | tee -a "$OUT/machine.txt"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 0 -m cuda tests 2>&1 | tee "$OUT/tests.log"
    # Engine-style loads (parameters first, each tensor copied in and dropped): peak device memory above
    # the parameters must stay within the window (issue 17 §1); exit 1 otherwise.
    timeout 60 python3 benchmarks/device_window.py --size 2GiB --json > "$OUT/device-window.json" 2>> "$OUT/bench.log"
    echo "device window exit $?" | tee -a "$OUT/tests.log"
    # The node cache's GPU tier (issue 18 §8): copies from page-locked segments, and a daemon's device copies
    # (--device cuda:0) copied device to device or viewed read-only, against a direct load.
    timeout 150 python3 benchmarks/cache_gpu_bench.py --size 2GiB --rounds 3 --json "$OUT/cache-gpu-2gib.json" \
        2>> "$OUT/bench.log" | tee -a "$OUT/cache-gpu.log"
    echo "cache gpu bench exit ${PIPESTATUS[0]}" | tee -a "$OUT/tests.log"
    # Warm and cold as separate runs, so that a timeout in one keeps the other's figures.
    for cache in warm cold; do
        timeout 200 python3 -m weightstream.cli bench --device cuda --size 8GiB --shards 4 --rounds 2 --page-cache "$cache" \
            --cache-dir /tmp/ws-cache --json 2>> "$OUT/bench.log" > "$OUT/bench-cuda-8gib-$cache.json"
        echo "bench $cache exit $?"
    done
    tail -40 "$OUT/bench.log"
}

"${1:?usage: gpu_check.sh prepare|run}"
