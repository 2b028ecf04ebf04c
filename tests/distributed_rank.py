"""One rank of a distributed-load test: ``python -m tests.distributed_rank INIT RANK WORLD URI MODE [VICTIM]``.

Modes: ``load`` (every tensor, compared with a single-process load), ``filter`` (only layer 1), ``cache`` (every
rank through the node cache at ``$WEIGHTSTREAM_TEST_CACHE``), ``cache-some`` (the even ranks only),
``staged`` (every tensor through a small staging ring with the CPU engine), ``cuda`` (every
tensor to this rank's GPU over NCCL),
``kill`` / ``abandon`` / ``fail`` / ``other-filter`` (rank VICTIM is killed after its first tensor,
stops iterating, has a read fail, or plans another load; the others must raise), ``plan-fail`` /
``sizing-fail`` / ``memory-fail`` (rank VICTIM fails planning, sizing the load before the plan check,
or allocating after it). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import weightstream


def main(init: str, rank: int, world: int, uri: str, mode: str, victim: int) -> dict:
    backend = "nccl" if mode == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init, rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60)
    )
    stats = weightstream.DistributedStats()
    options: dict = {"stats": stats, "chunk_bytes": 256 << 10, "threads": 3}
    if mode == "cache" or (mode == "cache-some" and rank % 2 == 0):
        options["cache"] = os.environ["WEIGHTSTREAM_TEST_CACHE"]
    if mode == "cuda":
        options["device"] = f"cuda:{rank % torch.cuda.device_count()}"
    wanted = (lambda name: ".layers.1." in name) if mode == "filter" else None
    if wanted is not None:
        options["filter"] = wanted
    me = rank == victim
    if me and mode == "other-filter":
        options["filter"] = lambda name: ".layers.0." in name
    if me and mode == "fail":

        def fail(nbytes: int) -> None:
            raise OSError(5, "injected read failure")

        options["progress"] = fail
    if me and mode == "plan-fail":
        uri = uri + "-not-on-this-rank"
    if me and mode in ("sizing-fail", "memory-fail"):
        import weightstream.readers.distributed as reader

        def injected(*args: object, **kwargs: object) -> None:
            raise weightstream.HostMemoryError(f"injected {mode}")

        if mode == "sizing-fail":
            reader.check_fits = injected  # fails before the plan check
        else:
            reader._HostLanding.__init__ = injected  # fails after it: an mmap ENOMEM while allocating
    result: dict = {"rank": rank}
    start = time.perf_counter()
    try:
        loaded = {}
        for name, tensor in (
            staged(uri, options, result)
            if mode == "staged"
            else weightstream.iter_weights(uri, format="distributed", **options)
        ):
            loaded[name] = tensor
            if me and mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if me and mode == "abandon":
                break
        reference = weightstream.load_weights(uri, filter=wanted)
        result["bit_exact"] = loaded.keys() == reference.keys() and all(
            torch.equal(loaded[n].cpu().view(torch.uint8), reference[n].view(torch.uint8)) for n in reference
        )
        result["tensors"] = len(loaded)
    except weightstream.WeightstreamError as error:
        result["error"] = [type(error).__name__, str(error)]
    except OSError as error:
        result["error"] = [type(error).__name__, str(error)]
    result["seconds"] = time.perf_counter() - start
    result["stats"] = vars(stats)
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return result


def staged(uri: str, options: dict, result: dict):
    """The load through a small staging ring with the CPU engine (random delays, checking slot
    reuse): the CUDA path's structure, minus the device and NCCL."""
    from tests.engines import DelayedCheckingEngine
    from weightstream.memory.ring import CpuStaging
    from weightstream.readers.distributed import read_distributed
    from weightstream.sources import store_for

    engines = []

    def engine() -> DelayedCheckingEngine:
        engines.append(DelayedCheckingEngine(seed=len(engines)))
        return engines[-1]

    with weightstream.open(
        uri, format="distributed", staging_slots=2, staging_slot_bytes=64 << 10, **options
    ) as checkpoint:
        plan, opts = checkpoint.plan, checkpoint.options
    yield from read_distributed(
        store_for(plan.uri), plan, opts, None, staging=CpuStaging(engine), stats=options["stats"]
    )
    result["copies"] = sum(e.launched for e in engines)
    result["violations"] = [v for e in engines for v in e.violations]


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
        int(sys.argv[6]) if len(sys.argv) > 6 else -1,
    )
