"""Host-device copy bandwidth through zcore's offload paths, against a plain
pinned ``copy_(non_blocking=True)`` on a side stream (cudaMemcpyAsync), and
the device-to-device bandwidth that bounds a device Adam step.

Each path is driven through the objects and calls the engine itself uses,
built over one parameter group of the size measured:

host to device (H2D)
  torch pinned       peer: a page-locked tensor (pin_memory=True) copied with
                     copy_(non_blocking=True) on a side stream, then waited for
  torch pageable     reference: an ordinary host tensor, copy_()
  ShardStore fetch   offload_param {device: cpu, pin_memory: true}: a HOST-tier
                     group's shard (zcore.zero3.shard_store.ShardStore, pinned
                     by place()) staged to the device by fetch() on the store's
                     copy stream, ready() making the current stream wait
  swap staging       the NVMe read path's last hop (zcore.memory.swap: a
                     zcore.memory.staging.Staging buffer of a HostBufferPool,
                     registered with cudaHostRegister, copied into the device
                     tensor as SwapManager's to_device does)
  offload write-back ZeRO-Offload's updated bf16 shard to the device:
                     zcore.step.sharded_optimizer.FusedCpuUpdate's staging
                     tensor written into the group through StoredShards and
                     ShardStore.write, as after each CPU Adam step (pin_memory:
                     true, as gpu_step: page-locked as the master is)
device to host (D2H)
  torch pinned, torch pageable   as above, the other way
  swap staging       SwapManager.swap_out's first hop: the device tensor
                     copied into a pool buffer before the NVMe write
  offload gradients  ZeRO-Offload's fp32 gradient shard to the host:
                     TorchUpdate.grad_source, into the host_grads buffer that
                     the engine allocates beside the (pinned) master shards
device to device (D2D)
  copy_ of a device tensor; GB/s counts read + write (2 x bytes), as
  bench/gpu_adam.py does. Adam's HBM bound follows from the 1 GiB figure:
  28 bytes per parameter (read p, g, m, v; write p, m, v).

Each figure is the median of several copies (10 up to 64 MiB, 5 at 256 MiB,
3 at 1 GiB, after one warm-up), each timed from a torch.cuda.synchronize()
to the next, so it includes the path's Python overhead (it matters at 1 MiB).
GB = 1e9 bytes. The "pinned" column is torch's is_pinned() of the host
buffer the path copies from or into. Sizes run in ascending order; a size is
left out (with every larger one) when, extrapolating the last two sizes'
times, it would end past --budget-s seconds.

Without a GPU it says so and exits 0; --tiny runs every path at 1 and 4 MiB
with CPU tensors in place of device ones (no streams, no pinning), to check
that the code path runs: its figures mean nothing.

    python bench/gpu_copy.py [--sizes-mib 1 4 16 64 256 1024] [--budget-s 25]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from typing import Callable

import torch

MIB = 1 << 20
BYTES_PER_ADAM_PARAM = 28
ADAM_PARAMS = (250_000_000, 355_000_000)  # bench/gpu_adam.py's check size; bench/gpu_step.py's GPT


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=None,
                        help="bytes per copy, MiB (default 1 4 16 64 256 1024; --tiny 1 4)")
    parser.add_argument("--budget-s", type=float, default=25.0, help="sizes that would end later are left out")
    parser.add_argument("--tiny", action="store_true", help="CPU tensors stand in for device ones: a code-path check")
    args = parser.parse_args()
    args.sizes_mib = sorted(args.sizes_mib or ([1, 4] if args.tiny else [1, 4, 16, 64, 256, 1024]))
    return args


def repeats(nbytes: int) -> int:
    return 10 if nbytes <= 64 * MIB else 5 if nbytes <= 256 * MIB else 3


class Paths:
    """The copies measured, each a zero-argument callable per size."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device = device
        self.pin = pin
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        from zcore.memory.staging import make_pool

        # The swap manager's pool, as zcore.memory.swap makes it (lock "try").
        self.pool = make_pool(1 << 31, "try")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def side_stream(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    # --- torch: the peer and the reference ---
    def torch_copy(self, nbytes: int, to_device: bool, pinned: bool) -> tuple[Callable[[], None], bool]:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and self.pin)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst, src = (dev, host) if to_device else (host, dev)
        if pinned:
            def run() -> None:
                with self.side_stream():
                    dst.copy_(src, non_blocking=True)
                if self.side is not None:
                    self.side.synchronize()
        else:
            def run() -> None:
                dst.copy_(src)
        return run, host.is_pinned()

    # --- zcore.memory.staging / zcore.memory.swap ---
    def swap_staging(self, nbytes: int, to_device: bool) -> tuple[Callable[[], None], bool]:
        from zcore.memory.staging import Staging, as_bytes

        staging = Staging(self.pool, nbytes)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if to_device:
            def run() -> None:  # SwapManager.swap_in's to_device
                as_bytes(dev).copy_(staging.bytes)
        else:
            def run() -> None:  # SwapManager.swap_out's staging copy
                staging.bytes.copy_(as_bytes(dev))
        return run, staging.bytes.is_pinned()

    # --- zcore.zero3.shard_store: a HOST-tier group ---
    def _group(self, numel: int, dtype: torch.dtype):
        from zcore.zero3.sharded_group import ShardedGroup

        param = torch.nn.Parameter(torch.empty(numel, dtype=torch.float32, device="meta"))
        return ShardedGroup(0, [param], 1, 0, self.device, dtype)

    def shard_fetch(self, nbytes: int) -> tuple[Callable[[], None], bool]:
        from zcore import _C
        from zcore.zero3.shard_store import ShardStore

        group = self._group(nbytes // 2, torch.bfloat16)
        store = ShardStore([group], [_C.ShardTier.HOST], pin=self.pin)
        store.place(0, torch.zeros(group.shard_numel, dtype=torch.bfloat16))

        def run() -> None:
            store.fetch(0)
            store.ready(0)
            store.source(0)  # what the all-gather reads
            store.drop(0)

        return run, group.local_shard.is_pinned()

    # --- zcore.step.sharded_optimizer: ZeRO-Offload, stage 3 ---
    def _offload_update(self, numel: int, pin_master: bool):
        from zcore import _C
        from zcore.step.sharded_optimizer import (
            FusedCpuUpdate,
            MasterShards,
            StoredShards,
        )
        from zcore.zero3.shard_store import ShardStore

        group = self._group(numel, torch.bfloat16)
        store = ShardStore([group], [_C.ShardTier.DEVICE], pin=False)
        store.place(0, torch.zeros(numel, dtype=torch.bfloat16))
        grads = torch.zeros(numel, dtype=torch.float32, device=self.device)

        class Reducer:  # the gradient reducer's one call here: this unit's fp32 shard
            def grad_shard(self, unit: int) -> torch.Tensor:
                return grads

        class Fetcher:  # zcore.zero3.param_fetcher's shard calls, without its plans (no NVMe here)
            def read_shard(self, g: int) -> torch.Tensor:
                return store.read(g)

            def write_shard(self, g: int, values: torch.Tensor) -> None:
                store.write(g, values)

        master = MasterShards([group], torch.device("cpu"), pin_memory=pin_master and self.pin)
        update = FusedCpuUpdate(None, master, Reducer(), StoredShards(Fetcher()))  # type: ignore[arg-type]
        return group, update

    def offload_writeback(self, nbytes: int) -> tuple[Callable[[], None], bool]:
        # pin_memory: true, as gpu_step: the staging tensor is page-locked as the master is.
        group, update = self._offload_update(nbytes // 2, pin_master=True)
        staging = update.staging[0]

        def run() -> None:
            update.shards.write(group, staging)  # FusedCpuUpdate.apply's write-back

        return run, staging.is_pinned()

    def offload_grads(self, nbytes: int) -> tuple[Callable[[], None], bool]:
        _, update = self._offload_update(nbytes // 4, pin_master=True)  # pin_memory: true, as gpu_step
        host = update.host_grads[0] if update.host_grads is not None else update.grad_source(0)

        def run() -> None:
            update.grad_source(0)

        return run, host.is_pinned()

    def device_copy(self, nbytes: int) -> tuple[Callable[[], None], bool]:
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        return (lambda: dst.copy_(src)), False


# (label, direction, what the engine does there, factory)
PATHS: list[tuple[str, str, str, Callable[[Paths, int], tuple[Callable[[], None], bool]]]] = [
    ("torch pinned, non_blocking, side stream (peer)", "H2D", "cudaMemcpyAsync",
     lambda p, n: p.torch_copy(n, True, True)),
    ("torch pageable copy_ (reference)", "H2D", "-", lambda p, n: p.torch_copy(n, True, False)),
    ("zcore ShardStore.fetch + ready", "H2D", "offload_param cpu: shard to device, copy stream",
     lambda p, n: p.shard_fetch(n)),
    ("zcore swap staging -> device", "H2D", "NVMe read's last hop (pool buffer)",
     lambda p, n: p.swap_staging(n, True)),
    ("zcore offload write-back", "H2D", "ZeRO-Offload: updated bf16 shard to device",
     lambda p, n: p.offload_writeback(n)),
    ("torch pinned, non_blocking, side stream (peer)", "D2H", "cudaMemcpyAsync",
     lambda p, n: p.torch_copy(n, False, True)),
    ("torch pageable copy_ (reference)", "D2H", "-", lambda p, n: p.torch_copy(n, False, False)),
    ("zcore device -> swap staging", "D2H", "NVMe write's first hop (pool buffer)",
     lambda p, n: p.swap_staging(n, False)),
    ("zcore offload gradients", "D2H", "ZeRO-Offload: fp32 grad shard to host",
     lambda p, n: p.offload_grads(n)),
    ("device copy_ (read + write counted)", "D2D", "the HBM bound of a device Adam step",
     lambda p, n: p.device_copy(n)),
]


def measure(paths: Paths, make, nbytes: int, count: int) -> tuple[float, bool]:
    """GB/s of one path at one size, and whether its host buffer is pinned."""
    run, pinned = make(paths, nbytes)
    run()  # warm-up: first touch of pageable memory, the caching allocator
    times = []
    for _ in range(count):
        paths.sync()
        start = time.perf_counter()
        run()
        paths.sync()
        times.append(time.perf_counter() - start)
    del run
    gc.collect()
    return nbytes / statistics.median(times) / 1e9, pinned


def predict(took: list[tuple[int, float]], mib: int) -> float:
    """Seconds the next size will take: a line through the last two sizes'
    times (a fixed part, then time in proportion to bytes), with a margin;
    after one size, that size's time scaled by bytes."""
    if not took:
        return 0.0
    if len(took) == 1:
        return took[0][1] * mib / took[0][0]
    (m0, t0), (m1, t1) = took[-2], took[-1]
    slope = max((t1 - t0) / (m1 - m0), 0.0)
    fixed = max(t1 - slope * m1, 0.0)
    return 1.25 * (fixed + slope * mib)


def main() -> int:
    args = parse_args()
    if args.tiny:
        device, pin, where = torch.device("cpu"), False, "CPU tensors in place of device ones (--tiny)"
        torch.set_num_threads(1)  # a code-path check; a shared 2-core machine is faster so
    elif not torch.cuda.is_available():
        print(f"skip: gpu_copy needs a GPU: torch {torch.__version__} sees none (torch.cuda.is_available() is "
              "False); --tiny checks the code path with CPU tensors")
        return 0
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        pin, where = True, torch.cuda.get_device_name(device)
    import zcore

    deadline = time.monotonic() + args.budget_s
    paths = Paths(device, pin)
    print(f"gpu_copy on {where}; zcore CUDA {'usable' if zcore.cuda_available() else 'not usable: ' + zcore.cuda_unavailable_reason()}; "
          f"swap pool registered with CUDA: {paths.pool.registered}; budget {args.budget_s:.0f} s", flush=True)
    gbs: dict[int, dict[int, float]] = {i: {} for i in range(len(PATHS))}
    pinned: dict[int, bool] = {}
    errors: dict[int, str] = {}
    left_out: list[int] = []
    took: list[tuple[int, float]] = []  # (MiB, seconds) of each size measured
    for mib in args.sizes_mib:
        if left_out or time.monotonic() + predict(took, mib) > deadline:
            left_out.append(mib)
            continue
        t0 = time.monotonic()
        nbytes = mib * MIB
        for i, (label, direction, _, make) in enumerate(PATHS):
            if i in errors:
                continue
            try:
                value, is_pinned = measure(paths, make, nbytes, repeats(nbytes))
            except Exception as exc:  # noqa: BLE001 - one path's failure is a row, not the end
                errors[i] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                print(f"  {direction} {label}: {errors[i]}", flush=True)
                continue
            if direction == "D2D":
                value *= 2  # read + write
            gbs[i][mib] = value
            pinned[i] = is_pinned
        if device.type == "cuda":
            torch.cuda.empty_cache()
        took.append((mib, time.monotonic() - t0))
        print(f"  {mib} MiB: {took[-1][1]:.1f} s ({args.budget_s - (deadline - time.monotonic()):.1f} s in all)",
              flush=True)

    sizes = [m for m in args.sizes_mib if m not in left_out]
    print()
    print(f"Copy bandwidth, GB/s (1e9 bytes/s), on {where}; median of 10/5/3 copies (<=64 MiB/256 MiB/1 GiB)"
          + ("; --tiny: the figures mean nothing" if args.tiny else ""))
    print("| direction | path | engine use | pinned | " + " | ".join(f"{m} MiB" for m in sizes) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---:" for _ in sizes) + " |")
    for i, (label, direction, use, _) in enumerate(PATHS):
        if i in errors:
            print(f"| {direction} | {label} | {use} | - | failed: {errors[i].replace('|', '/')} |"
                  + " |" * (len(sizes) - 1))
            continue
        cells = " | ".join(f"{gbs[i][m]:.1f}" if m in gbs[i] else "-" for m in sizes)
        pin_cell = "-" if direction == "D2D" else ("yes" if pinned.get(i) else "no")
        print(f"| {direction} | {label} | {use} | {pin_cell} | {cells} |")
    if left_out:
        print(f"left out (budget of {args.budget_s:.0f} s spent): {', '.join(f'{m} MiB' for m in left_out)}")

    d2d = next((i for i, p in enumerate(PATHS) if p[1] == "D2D"), None)
    bound = None
    if d2d is not None and gbs[d2d]:
        at = max(gbs[d2d])
        bw = gbs[d2d][at]
        bound = {"copy_gbs": round(bw, 1), "at_mib": at, "params_per_s": bw * 1e9 / BYTES_PER_ADAM_PARAM,
                 "step_ms": {str(n): round(n * BYTES_PER_ADAM_PARAM / (bw * 1e9) * 1e3, 3) for n in ADAM_PARAMS}}
        print()
        print(f"Adam's HBM bound from the device copy of {at} MiB (read + write {bw:.0f} GB/s, "
              f"{BYTES_PER_ADAM_PARAM} B/param): compare bench/gpu_adam.py's GB/s column with {bw:.0f}")
        print("| params | bound: ms per Adam step | Gparams/s |")
        print("| ---: | ---: | ---: |")
        for n in ADAM_PARAMS:
            print(f"| {n / 1e6:.0f}M | {bound['step_ms'][str(n)]:.2f} | {bound['params_per_s'] / 1e9:.2f} |")
    stats = paths.pool.stats()
    summary = {
        "bench": "gpu_copy",
        "tiny": args.tiny,
        "device": where,
        "pool_registered": paths.pool.registered,
        "pool": {"held": stats.held, "allocations": stats.allocations, "reuses": stats.reuses},
        "sizes_mib": sizes,
        "left_out_mib": left_out,
        "rows": [
            {"direction": direction, "path": label, "use": use, "pinned": pinned.get(i),
             "gbs": {str(m): round(v, 3) for m, v in gbs[i].items()}, **({"error": errors[i]} if i in errors else {})}
            for i, (label, direction, use, _) in enumerate(PATHS)
        ],
        "adam_bound": bound,
    }
    print("BENCH_JSON " + json.dumps(summary), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
