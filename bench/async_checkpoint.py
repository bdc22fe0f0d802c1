"""Asynchronous checkpoint saves: how long the training loop is blocked per
save, zcore synchronous against zcore asynchronous against DCP's
``torch.distributed.checkpoint.async_save`` of an FSDP2 model of the same
bytes; and the training's steps per second while a background save runs,
against none. 2 gloo CPU ranks.

Both systems train the same model (a stack of nn.Linear(width, width),
fp32, AdamW) for one step, so that optimizer states exist, then save it
--repeats times, the median shown:
- zcore, ZeRO stage 3: ``engine.save_checkpoint(dir, tag)`` and
  ``engine.save_checkpoint(dir, tag, async_save=True)``;
- DCP: ``fully_shard`` (FSDP2) on every Linear and the root,
  ``get_state_dict(model, optimizer)``, then ``dcp.save`` and
  ``dcp.async_save`` with one DefaultStager kept across saves (its staging
  buffers are reused, as zcore's copy is) and a gloo group of its own for
  the background collectives, as zcore's writer has.
Blocked: from a barrier to the slower rank's return from the save call.
Write: from the call to the save being on disk (an asynchronous save waited
for at once). Steps/s: --steps training steps right after an asynchronous
save returned (the write runs meanwhile), against --steps steps with no
save pending. The page cache is written back (os.sync) before every save.

    python bench/async_checkpoint.py [--params 75e6] [--repeats 3] [--steps 3] [--dir /tmp]
    python bench/async_checkpoint.py --params 2e6 --repeats 1 --steps 2   # a quick run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from _ranks import run_local_ranks

WORLD = 2
MICRO_BATCH = 2
LR = 1e-4


@dataclass(frozen=True)
class Options:
    width: int
    layers: int
    repeats: int
    steps: int
    work: Path


def build_model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same weights in every rank and both systems
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def batch(width: int, rank: int, step: int) -> torch.Tensor:
    return torch.randn(MICRO_BATCH, width, generator=torch.Generator().manual_seed(1000 * step + rank))


def slowest(seconds: float) -> float:
    """The slowest rank's ``seconds``."""
    import torch.distributed as dist

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn()`` on the slowest rank, after a write-back of the
    page cache and a barrier."""
    import torch.distributed as dist

    os.sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(step: Callable[[int], None], save: Callable[[str], None], save_async: Callable[[str], Any],
            finish: Callable[[Any], None], root: Path, rank: int, opts: Options) -> dict:
    """The figures of one system, given its ``step(k)``, ``save(tag)``,
    ``save_async(tag)`` (returns a handle) and ``finish(handle)``."""
    import torch.distributed as dist

    step(0)
    out: dict[str, list[float]] = {k: [] for k in ("sync", "async", "write", "steps_idle", "steps_busy")}
    for r in range(opts.repeats):
        out["sync"].append(timed(lambda: save(f"sync{r}")))
        handle: list[Any] = []
        out["write"].append(timed(lambda: finish(save_async(f"write{r}"))))
        out["steps_idle"].append(opts.steps / timed(lambda: [step(k) for k in range(1, 1 + opts.steps)]))
        out["async"].append(timed(lambda: handle.append(save_async(f"async{r}"))))
        out["steps_busy"].append(opts.steps / timed(lambda: [step(k) for k in range(1, 1 + opts.steps)]))
        finish(handle[0])
        dist.barrier()
    out["bytes"] = [float(tree_bytes(root / "sync0")) if rank == 0 else 0.0]
    return {k: statistics.median(v) for k, v in out.items()}


def zcore_rank(rank: int, world: int, opts: Options) -> dict:
    import zcore

    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000,
                              "stage3_max_live_parameters": 100_000_000},
    }
    engine, *_ = zcore.initialize(model=build_model(opts.width, opts.layers), config=config)
    root = opts.work / "zcore"

    def step(k: int) -> None:
        engine.backward(engine(batch(opts.width, rank, k)).pow(2).mean())
        engine.step()

    try:
        result = measure(step, lambda tag: engine.save_checkpoint(root, tag=tag),
                         lambda tag: engine.save_checkpoint(root, tag=tag, async_save=True),
                         lambda _: engine.wait_for_checkpoint(), root, rank, opts)
        result["copy_bytes"] = engine.memory_report().checkpoint_copy
    finally:
        engine.destroy()
    return result


def dcp_rank(rank: int, world: int, opts: Options) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(opts.width, opts.layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    writer_group = dist.new_group(backend="gloo")
    stager = DefaultStager(StagingOptions(False, False, False, False))  # no CUDA: plain copies, kept
    root = opts.work / "dcp"

    def step(k: int) -> None:
        model(batch(opts.width, rank, k)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def state() -> dict:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    try:
        return measure(step, lambda tag: dcp.save(state(), checkpoint_id=root / tag),
                       lambda tag: dcp.async_save(state(), checkpoint_id=root / tag, process_group=writer_group,
                                                  async_stager=stager),
                       lambda future: future.result(), root, rank, opts)
    finally:
        stager.close()
        dist.destroy_process_group()


def print_table(results: dict[str, dict], opts: Options) -> None:
    params = opts.layers * (opts.width * opts.width + opts.width)
    print(f"\nmodel: {opts.layers} x Linear({opts.width}, {opts.width}), {params / 1e6:.1f}M parameters "
          f"({params * 4 / 1e6:.0f} MB fp32), AdamW; {WORLD} gloo CPU ranks; median of {opts.repeats}")
    print(f"{'system':8}{'ckpt GB':>9}{'sync save s':>13}{'async blocked s':>17}{'write s':>9}"
          f"{'blocked/sync':>14}{'steps/s idle':>14}{'steps/s saving':>16}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:8}{r['error']}")
            continue
        print(f"{name:8}{r['bytes'] / 1e9:>9.2f}{r['sync']:>13.3f}{r['async']:>17.3f}{r['write']:>9.3f}"
              f"{r['async'] / r['sync']:>14.1%}{r['steps_idle']:>14.2f}{r['steps_busy']:>16.2f}")
    if "error" not in results["zcore"]:
        print(f"zcore's host copy per rank (rank 0): {results['zcore']['copy_bytes'] / 2**20:.1f} MiB")
    if all("error" not in r for r in results.values()):
        ratio = results["zcore"]["async"] / results["DCP"]["async"]
        print(f"zcore async blocked / DCP async blocked: {ratio:.2f}x (<1: zcore blocks less)")


def parse_options() -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=75e6, help="model size (default 75e6: 300 MB fp32)")
    parser.add_argument("--width", type=int, default=2048, help="Linear width (default 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="saves of each kind per system (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="training steps timed per rate (default 3)")
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temporary dir)")
    args = parser.parse_args()
    layers = max(1, round(args.params / (args.width * args.width + args.width)))
    work = Path(tempfile.mkdtemp(prefix="zcore-async-ckpt-", dir=args.dir))
    return Options(args.width, layers, args.repeats, args.steps, work)


def main() -> None:
    opts = parse_options()
    results: dict[str, dict] = {}
    try:
        for name, target in (("zcore", zcore_rank), ("DCP", dcp_rank)):
            print(f"running {name} ...", flush=True)
            ranks = run_local_ranks(target, WORLD, opts)
            results[name] = ranks if isinstance(ranks, dict) else ranks[0]
    finally:
        shutil.rmtree(opts.work, ignore_errors=True)
    print_table(results, opts)


if __name__ == "__main__":
    main()
