#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py says what each step proves).
#
# Here (a machine with PyPI), once:   benchmarks/gpu_check.sh prepare
#   downloads the peers' wheels for the device image's Python 3.12 into .whl/ (git-ignored), with NIXL's and
#   Debian's etcd-server for the fleet-gpu step (47 MiB in all: under the device tool's 64 MiB with the tree).
# On the lent GPU machine (device tool: carry [".whl"], timeout_s 560):   benchmarks/gpu_check.sh run
#   runs every step under its own limit (480 s in all, `benchmarks/gpu_check.sh --list`); results in $OUT.
# Without a GPU:   benchmarks/gpu_check.sh run --dry-run   (every step's non-GPU part, and the summary)
set -uo pipefail
cd "$(dirname "$0")/.."

PEERS=(fastsafetensors==0.5.0 runai-model-streamer==0.17.1 instanttensor==0.2.2 humanize==4.12.3 typer==0.16.0)
NIXL=nixl-cu12==1.5.1

prepare() {
    grep -qxF /.whl/ .git/info/exclude || echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${PEERS[@]}"
    # NIXL for the fleet-gpu step: its wheel (65 MiB) alone passes the device tool's 64 MiB; without its
    # expert-parallel kernels (nixl_ep_cu12, not used here) it is 29 MiB.
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d /tmp/gpu-check-nixl "$NIXL" &&
        python3 benchmarks/gpu_check.py slim-wheel /tmp/gpu-check-nixl/nixl_cu12-*.whl .whl nixl_ep_cu12/
    # etcd for the same step (tests/etcd_server.py unpacks it from here: the GPU machine has no network).
    (cd .whl && apt-get download etcd-server)
    ls -la .whl && du -sh .whl
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; exec python3 benchmarks/gpu_check.py run "$@" ;;
    --list) exec python3 benchmarks/gpu_check.py --list ;;
    *) echo "usage: gpu_check.sh prepare | run [--dry-run] | --list" >&2; exit 2 ;;
esac
