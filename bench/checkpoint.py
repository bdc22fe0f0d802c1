"""Checkpoint save, load and consolidation: zcore against torch.save/torch.load
of the same state and against DeepSpeed, on 2 gloo CPU ranks.

Every system trains the same model (a stack of nn.Linear(width, width) layers,
fp32, torch.optim.AdamW) at the same ZeRO stage (3 by default: the smallest
footprint per rank, so that 2 ranks of a 500M-parameter model fit in 23 GiB)
for one step, so optimizer states exist, then saves and loads it --repeats
times, the median shown; each framework runs in
its own pair of spawned ranks, one framework after the other. A save or load
is timed between barriers (the slower rank's time); GB/s is the bytes the save
left on disk (1e9 B/s) over that time. Before every save the page cache is
flushed (os.sync) and before every load the checkpoint's pages are evicted
(POSIX_FADV_DONTNEED), so loads read from the disk (--warm-cache keeps them).

- zcore: engine.save_checkpoint / engine.load_checkpoint (fsyncs every file).
- torch.save: in the zcore ranks, each rank torch.save's what zcore saves of
  it (its fp32 master shards and its inner optimizer's state_dict) to one
  file and torch.load's it back; once as-is and once with an os.fsync of the
  file. The load column is torch.load alone; putting the loaded state back
  into the engine is timed apart (zcore's load includes it).
- DeepSpeed: engine.save_checkpoint / engine.load_checkpoint (no fsync).

Consolidation: zcore.checkpoint.consolidate and DeepSpeed's zero_to_fp32
(convert_zero_checkpoint_to_fp32_state_dict, safetensors output) each run
once in a fresh subprocess on the last checkpoint saved, which reports its
peak RSS (VmHWM) and its peak anonymous RSS (sampled every 10 ms: DeepSpeed
reads through mmap, whose page-cache pages count in RSS but are reclaimable).

    python bench/checkpoint.py [--params 500e6] [--stage 3] [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from _ranks import run_local_ranks

WORLD = 2
MICRO_BATCH = 2
LR = 1e-4
GIB = 2**30
ROWS = ["zcore", "torch.save", "torch.save+fsync", "DeepSpeed"]


@dataclass(frozen=True)
class Options:
    width: int
    layers: int
    stage: int
    repeats: int
    work: Path  # checkpoints live here; deleted at the end
    evict: bool
    timeout: float


# The model.
def model_shape(params: float, width: int | None) -> tuple[int, int]:
    """(width, layers) of a stack of Linear(width, width) with ~params parameters."""
    if width is None:
        width = 4096 if params >= 128e6 else 1024
    return width, max(1, round(params / (width * width + width)))


def build_model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same weights in every rank and every framework
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def ds_config(stage: int) -> dict:
    """One config for both frameworks (zcore reads DeepSpeed's keys). The
    smaller buckets and live budget (defaults 5e8 and 1e9 elements) keep a
    500M-parameter model's 2 ranks within this machine's 23 GiB: at the
    defaults zcore reserves a gather arena of the whole model per rank and
    DeepSpeed's reduce bucket is 5e8 elements (2 GB in fp32). Neither
    changes what a checkpoint holds."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 50_000_000,
            "allgather_bucket_size": 50_000_000,
            "stage3_max_live_parameters": 100_000_000,
        },
        "zero_allow_untested_optimizer": True,
    }


def train_step(engine: Any, width: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(MICRO_BATCH, width, generator=gen)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


# Files and the page cache.
def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def settle(rank: int, evict: list[Path]) -> None:
    """Rank 0 writes back every dirty page and evicts ``evict``'s files from
    the page cache; then both ranks go on together."""
    import torch.distributed as dist

    if rank == 0:
        os.sync()
        for root in evict:
            files = [root] if root.is_file() else [f for f in root.rglob("*") if f.is_file()]
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dist.barrier()


def between_barriers(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


# The ranks.
def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def _torch_state(engine: Any) -> dict:
    """What zcore saves of this rank: fp32 master shards and optimizer states."""
    optimizer = engine.optimizer
    return {"master": list(optimizer.master.shards), "optimizer": optimizer.inner.state_dict()}


def _torch_save(state: dict, path: Path, fsync: bool) -> None:
    torch.save(state, path)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _torch_restore(engine: Any, state: dict) -> None:
    """Puts a torch.load'ed state back, as zcore's load_checkpoint commits
    it: master shards, the parameters' shards, republished, then the
    optimizer states."""
    from zcore.zero3.param_fetcher import ParamFetcher

    optimizer = engine.optimizer
    with torch.no_grad():
        for shard, saved in zip(optimizer.master.shards, state["master"]):
            shard.copy_(saved)
        for unit, shard in zip(optimizer.units, optimizer.master.shards):
            unit.local_shard.copy_(shard)
    if isinstance(engine.residency, ParamFetcher):
        engine.residency.reload()
    else:
        optimizer.publisher.publish()
    optimizer.inner.load_state_dict(state["optimizer"])


def _engine_round(engine: Any, root: Path, tag: str, rank: int, opts: Options, keep: bool) -> dict:
    """One save and load with ``engine``'s own methods; deletes the tag
    unless ``keep``."""
    import torch.distributed as dist

    settle(rank, [])
    save = between_barriers(lambda: engine.save_checkpoint(str(root), tag=tag))
    nbytes = tree_bytes(root / tag) if rank == 0 else 0
    settle(rank, [root / tag] if opts.evict else [])
    load = between_barriers(lambda: engine.load_checkpoint(str(root), tag=tag))
    if rank == 0 and not keep:
        shutil.rmtree(root / tag)
    dist.barrier()
    return {"save": save, "load": load, "bytes": nbytes}


def _torch_round(engine: Any, root: Path, rank: int, opts: Options, fsync: bool) -> dict:
    """One torch.save and torch.load of what zcore saves, one file per rank."""
    import torch.distributed as dist

    root.mkdir(parents=True, exist_ok=True)
    files = [root / f"rank-{r}.pt" for r in range(WORLD)]
    state = _torch_state(engine)
    settle(rank, [])
    save = between_barriers(partial(_torch_save, state, files[rank], fsync))
    del state
    nbytes = sum(f.stat().st_size for f in files) if rank == 0 else 0
    settle(rank, files if opts.evict else [])
    loaded: dict = {}
    load = between_barriers(lambda: loaded.update(state=torch.load(files[rank], weights_only=True)))
    restore = between_barriers(lambda: _torch_restore(engine, loaded.pop("state")))
    publish = between_barriers(engine.optimizer.publisher.publish) if engine.zero_stage < 3 else 0.0
    dist.barrier()
    files[rank].unlink()
    return {"save": save, "load": load, "bytes": nbytes, "restore": restore, "publish": publish}


def _zcore_rank(rank: int, world: int, opts: Options) -> tuple[dict[str, list[dict]], float]:
    """zcore's and torch.save's rounds on this rank, and its peak RSS (GiB)."""
    import zcore

    model = build_model(opts.width, opts.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = zcore.initialize(model=model, config=ds_config(opts.stage), optimizer=optimizer)
    train_step(engine, opts.width, rank)
    rounds: dict[str, Callable[[int], dict]] = {
        "zcore": lambda rep: _engine_round(
            engine, opts.work / "zcore", f"rep{rep}", rank, opts, keep=rep == opts.repeats - 1
        ),
        "torch.save": lambda rep: _torch_round(engine, opts.work / "torch", rank, opts, fsync=False),
        "torch.save+fsync": lambda rep: _torch_round(engine, opts.work / "torch", rank, opts, fsync=True),
    }
    runs: dict[str, list[dict]] = {name: [] for name in rounds}
    names = list(rounds)
    for rep in range(opts.repeats):
        # The disk drifts: rotate which system goes first.
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            runs[name].append(rounds[name](rep))
    return runs, _peak_rss_gib()


def _deepspeed_rank(rank: int, world: int, opts: Options) -> tuple[dict[str, list[dict]], float]:
    """DeepSpeed's rounds on this rank, and its peak RSS (GiB)."""
    import deepspeed

    model = build_model(opts.width, opts.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(opts.stage), optimizer=optimizer)
    train_step(engine, opts.width, rank)
    root = opts.work / "deepspeed"
    reps = [_engine_round(engine, root, f"rep{rep}", rank, opts, keep=rep == opts.repeats - 1)
            for rep in range(opts.repeats)]
    return {"DeepSpeed": reps}, _peak_rss_gib()


def run_ranks(target: Callable[..., tuple[dict, float]], opts: Options) -> tuple[dict[str, list[dict]], list[float]]:
    """Runs ``target`` on WORLD spawned ranks; returns its runs, each
    measurement the slower rank's, and each rank's peak RSS (GiB). A rank
    that fails, dies or runs past --timeout ends the benchmark."""
    results = run_local_ranks(target, WORLD, opts, timeout=opts.timeout)
    if isinstance(results, dict):
        raise RuntimeError(f"{target.__name__} failed: {results['error']}")
    merged = {}
    for row, reps in results[0][0].items():
        merged[row] = [
            {k: max(results[r][0][row][i][k] for r in range(WORLD)) for k in reps[i]} for i in range(len(reps))
        ]
    return merged, [results[r][1] for r in range(WORLD)]


# Consolidation, each in a fresh process.
def _consolidate_child(kind: str, checkpoint: str, tag: str, output: str) -> None:
    """Runs in the subprocess: one consolidation (or only its imports, for
    the baseline); prints its measurements as JSON on the last line."""
    peak_anon = [0]

    def sample() -> None:
        while True:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak_anon[0] = max(peak_anon[0], int(line.split()[1]))
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    if kind.startswith("zcore"):
        from zcore.checkpoint import consolidate
    else:
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    imported = time.perf_counter()
    if kind == "zcore":
        consolidate(checkpoint, output, tag=tag, dtype=torch.float32, progress=False)
    elif kind == "deepspeed":
        # max_shard_size=None: splitting needs huggingface_hub, not installed
        # here; the output (one file under 5 GB) is the same.
        convert_zero_checkpoint_to_fp32_state_dict(
            checkpoint, output, max_shard_size=None, safe_serialization=True, tag=tag
        )
    done = time.perf_counter()
    if kind == "deepspeed":  # zcore fsyncs its output; DeepSpeed does not
        for f in Path(output).iterdir():
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    synced = time.perf_counter()
    time.sleep(0.02)  # one more sample
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"import_s": imported - start, "run_s": done - imported, "fsync_s": synced - done,
                      "peak_kib": hwm, "peak_anon_kib": peak_anon[0]}))


def run_consolidation(kind: str, checkpoint: Path, tag: str, output: Path, opts: Options) -> dict:
    if opts.evict:
        os.sync()
        for f in (checkpoint / tag).rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
    command = [sys.executable, __file__, "--consolidate-child", kind, str(checkpoint), tag, str(output)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=opts.timeout,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"consolidation {kind} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    result["bytes"] = tree_bytes(output) if output.exists() else 0
    return result


def compare_outputs(zcore_dir: Path, deepspeed_dir: Path) -> str:
    """Both consolidated state dicts, tensor by tensor."""
    from safetensors import safe_open

    def tensors(out: Path) -> dict[str, Path]:
        where = {}
        for f in sorted(out.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                where.update(dict.fromkeys(st.keys(), f))
        return where

    ours, theirs = tensors(zcore_dir), tensors(deepspeed_dir)
    if set(ours) != set(theirs):
        return (f"key sets differ: only zcore {sorted(set(ours) - set(theirs))[:4]}, "
                f"only DeepSpeed {sorted(set(theirs) - set(ours))[:4]}")
    worst = 0.0
    for key in ours:
        with safe_open(str(ours[key]), "pt") as a, safe_open(str(theirs[key]), "pt") as b:
            x, y = a.get_tensor(key), b.get_tensor(key)
            if x.shape != y.shape or x.dtype != y.dtype:
                return f"{key}: zcore {x.dtype} {tuple(x.shape)}, DeepSpeed {y.dtype} {tuple(y.shape)}"
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return f"{len(ours)} tensors, same keys, shapes and dtypes, max |zcore - DeepSpeed| = {worst:.3g}"


# Report.
def _median(reps: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in reps)


def print_save_load(runs: dict[str, list[dict]], stage: int) -> None:
    print(f"\n{'system':18}{'save s':>9}{'save GB/s':>11}{'load s':>9}{'load GB/s':>11}{'bytes GB':>10}")
    for row in ROWS:
        reps = runs[row]
        save, load, nbytes = _median(reps, "save"), _median(reps, "load"), _median(reps, "bytes")
        print(f"{row:18}{save:>9.2f}{nbytes / save / 1e9:>11.2f}{load:>9.2f}{nbytes / load / 1e9:>11.2f}"
              f"{nbytes / 1e9:>10.3f}")
    z = runs["zcore"]
    for peer in ROWS[1:]:
        p = runs[peer]
        print(f"{peer} time / zcore time (>1: zcore faster): save {_median(p, 'save') / _median(z, 'save'):.2f}x, "
              f"load {_median(p, 'load') / _median(z, 'load'):.2f}x")
    for row in ("torch.save", "torch.save+fsync"):
        reps = runs[row]
        regather = "re-gathering persistent groups" if stage == 3 else "republishing parameters"
        publish = f"; republishing alone {_median(reps, 'publish'):.2f} s" if stage < 3 else ""
        print(f"{row}: putting the loaded state into the engine ({regather} included) took "
              f"{_median(reps, 'restore'):.2f} s more; zcore's load includes that step{publish}")
    for row in ROWS:
        print(f"{row}: save s per repeat " + ", ".join(f"{r['save']:.2f}" for r in runs[row])
              + "; load s " + ", ".join(f"{r['load']:.2f}" for r in runs[row]))


def print_consolidation(results: dict[str, dict], baselines: dict[str, dict], largest: int, agreement: str) -> None:
    print(f"\n{'consolidation':22}{'time s':>8}{'+fsync s':>10}{'process s':>11}{'peak RSS GiB':>14}"
          f"{'peak anon GiB':>15}{'imports-only RSS GiB':>22}{'output GB':>11}")
    for label, kind in (("zcore consolidate", "zcore"), ("DeepSpeed zero_to_fp32", "deepspeed")):
        r, b = results[kind], baselines[kind]
        print(f"{label:22}{r['run_s']:>8.2f}{r['fsync_s']:>10.2f}{r['process_s']:>11.2f}"
              f"{r['peak_kib'] / 2**20:>14.3f}{r['peak_anon_kib'] / 2**20:>15.3f}{b['peak_kib'] / 2**20:>22.3f}"
              f"{r['bytes'] / 1e9:>11.3f}")
    z, d = results["zcore"], results["deepspeed"]
    z_above = z["peak_kib"] - baselines["zcore"]["peak_kib"]
    d_above = d["peak_kib"] - baselines["deepspeed"]["peak_kib"]
    print(f"peak RSS DeepSpeed / zcore: {d['peak_kib'] / z['peak_kib']:.2f}x; above each one's imports-only "
          f"peak: {d_above / 2**20:.3f} / {z_above / 2**20:.3f} GiB")
    print("time s: the call alone (zcore's includes fsyncing its output); +fsync s: fsyncing DeepSpeed's "
          "output after it returned; process s: the whole subprocess, interpreter and imports included")
    print(f"largest single parameter: {largest / 2**20:.1f} MiB; outputs: {agreement}")


# The sequence of steps.
def parse_options() -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=500e6, help="model size (default 500e6)")
    parser.add_argument("--width", type=int, default=None, help="Linear width (default 4096, 1024 below 128M)")
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage of both (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per system; the median is shown")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="a fresh directory for the checkpoints is made here and deleted at the end")
    parser.add_argument("--warm-cache", action="store_true", help="do not evict checkpoints before loading")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for each set of ranks")
    parser.add_argument("--consolidate-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.consolidate_child:
        _consolidate_child(*args.consolidate_child)
        sys.exit(0)
    width, layers = model_shape(args.params, args.width)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zcore-bench-checkpoint-", dir=args.dir))
    return Options(width, layers, args.stage, args.repeats, work, not args.warm_cache, args.timeout)


def main() -> None:
    opts = parse_options()
    work = opts.work
    numel = opts.layers * (opts.width * opts.width + opts.width)
    print(f"load average at start: {os.getloadavg()}")
    print(f"model: {opts.layers} x Linear({opts.width}, {opts.width}) = {numel / 1e6:.1f}M parameters, fp32, "
          f"AdamW, ZeRO stage {opts.stage}, {WORLD} gloo ranks x 1 thread, {opts.repeats} repeat(s), "
          f"{'cold' if opts.evict else 'warm'} page cache for loads; checkpoints in {work}", flush=True)
    try:
        runs, peaks = run_ranks(_zcore_rank, opts)
        print(f"  zcore ranks done (peak RSS GiB {peaks[0]:.2f}/{peaks[1]:.2f})", flush=True)
        ds_runs, ds_peaks = run_ranks(_deepspeed_rank, opts)
        print(f"  DeepSpeed ranks done (peak RSS GiB {ds_peaks[0]:.2f}/{ds_peaks[1]:.2f})", flush=True)
        runs.update(ds_runs)

        tag = f"rep{opts.repeats - 1}"
        results, baselines = {}, {}
        for kind, checkpoint in (("zcore", work / "zcore"), ("deepspeed", work / "deepspeed")):
            results[kind] = run_consolidation(kind, checkpoint, tag, work / f"{kind}-fp32", opts)
            baselines[kind] = run_consolidation(f"{kind}-imports", checkpoint, tag, work / "none", opts)
            print(f"  {kind} consolidated in {results[kind]['run_s']:.2f} s", flush=True)
        agreement = compare_outputs(work / "zcore-fp32", work / "deepspeed-fp32")

        print_save_load(runs, opts.stage)
        print_consolidation(results, baselines, opts.width * opts.width * 4, agreement)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
