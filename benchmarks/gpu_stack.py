"""The stack a GPU check ran on, first in its report: torch and its CUDA, cuda-bindings, the driver, the kernel, and
the device attributes that choose weightstream's CUDA paths (page-locking read-only memory for the node cache's host
segments, the virtual memory API and POSIX descriptors for its device copies, GDS).

    python benchmarks/gpu_stack.py [--json stack.json]

Prints one line per fact; without a GPU it says so and exits 0 (a dry run's non-GPU part).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RUNTIME_ATTRIBUTES = (
    "cudaDevAttrHostRegisterSupported",
    "cudaDevAttrHostRegisterReadOnlySupported",
    "cudaDevAttrPageableMemoryAccessUsesHostPageTables",
)
DRIVER_ATTRIBUTES = (
    "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
    "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
    "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED",
)


def version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def stack() -> dict:
    """Everything above, as a dict."""
    import torch

    found: dict = {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_bindings": version("cuda-bindings"),
        "gpus": [],
    }
    if not torch.cuda.is_available():
        found["note"] = "no CUDA device: nothing below the versions was measured"
        return found
    from cuda.bindings import driver, runtime

    from weightstream.memory.gds import unavailable_reason

    driver.cuInit(0)
    _, driver_version = driver.cuDriverGetVersion()
    found["driver_cuda"] = f"{driver_version // 1000}.{driver_version % 1000 // 10}"
    for index in range(torch.cuda.device_count()):
        gpu: dict = {"index": index, "name": torch.cuda.get_device_name(index)}
        for name in RUNTIME_ATTRIBUTES:
            status, value = runtime.cudaDeviceGetAttribute(getattr(runtime.cudaDeviceAttr, name), index)
            gpu[name] = int(value) if status == runtime.cudaError_t.cudaSuccess else f"error {status}"
        _, device = driver.cuDeviceGet(index)
        for name in DRIVER_ATTRIBUTES:
            status, value = driver.cuDeviceGetAttribute(getattr(driver.CUdevice_attribute, name), device)
            gpu[name] = int(value) if status == driver.CUresult.CUDA_SUCCESS else f"error {status}"
        found["gpus"].append(gpu)
    found["gds"] = unavailable_reason(need_nvidia_fs=True) or "available (cuFile opens, nvidia-fs loaded)"
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args()
    report = stack()
    for key, value in report.items():
        if key != "gpus":
            print(f"{key}: {value}")
    for gpu in report["gpus"]:
        print(" ".join(f"{key}={value}" for key, value in gpu.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
