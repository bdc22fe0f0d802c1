"""The demo's training script, one process per rank (started by ``zcore demo``
through torch's launcher): a small byte-level GPT learns the text of zcore's
own Python sources with ZeRO-3, and rank 0 reports the loss and the memory
each rank holds against what DDP would need. With ``--nvme PATH``
(ZeRO-Infinity) parameter shards and optimizer states live in swap files
under PATH, and rank 0 also reports where each rank's bytes lived and the
bytes each rank read and wrote through its swap files, which are removed
at the end."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

import zcore
from zcore.demo.gpt import GPT, GPTConfig, lm_loss
from zcore.observe.memory_report import TIERS

MODEL = GPTConfig(vocab_size=256, seq_len=128, d_model=192, n_layers=4, n_heads=4)
_MIB = 2**20


def corpus() -> torch.Tensor:
    """The bytes of every Python source of the installed zcore package."""
    root = Path(zcore.__file__).parent
    text = b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(data: torch.Tensor, micro: int, rank: int, world: int, seed: int):
    """Random windows; each rank draws its own rows of every global batch."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - MODEL.seq_len - 1, (world * micro,), generator=gen)
        rows = starts[rank * micro : (rank + 1) * micro]
        windows = torch.stack([data[s : s + MODEL.seq_len + 1] for s in rows.tolist()])
        yield windows[:, :-1], windows[:, 1:]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--nvme", type=Path, default=None, metavar="PATH",
                        help="ZeRO-Infinity: parameters and optimizer states in swap files under PATH")
    parser.add_argument("--metrics", type=Path, default=None, metavar="DIR",
                        help="write every step's metrics as CSV files under DIR/zcore-demo (zcore plot DIR)")
    return parser.parse_args()


def training_config(steps: int, micro_batch: int, nvme: Optional[Path], monitor: Optional[Path] = None) -> dict:
    zero: dict = {
        "stage": 3,
        # Small enough that the demo's groups are really gathered and released.
        "stage3_param_persistence_threshold": 1000,
        "stage3_prefetch_bucket_size": 200_000,
    }
    if nvme is not None:
        # max_in_cpu 0: every shard on NVMe; by default (as DeepSpeed) the
        # first 1e9 elements of a rank's shards stay in host memory.
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme)}
    monitoring = {} if monitor is None else {
        "csv_monitor": {"enabled": True, "output_path": str(monitor), "job_name": "zcore-demo"},
    }
    return {
        **monitoring,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": steps, "warmup_num_steps": 30, "warmup_type": "linear"},
        },
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def main() -> None:
    args = parse_args()
    if args.nvme is not None:
        args.nvme.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    engine, *_ = zcore.initialize(model=GPT(MODEL), config=training_config(args.steps, args.micro_batch, args.nvme, args.metrics))
    rank, world = engine.context.rank, engine.context.world_size
    data = corpus()
    params = sum(p.numel() for p in GPT(MODEL).parameters())
    if rank == 0:
        where = "" if args.nvme is None else f"; parameters and optimizer states on NVMe under {args.nvme}"
        print(f"zcore demo: ZeRO-3 on {world} rank(s) ({engine.context.backend}, {engine.context.device}); "
              f"GPT with {params / 1e6:.2f}M parameters; corpus: {data.numel() / 1e3:.0f} kB of zcore's sources"
              f"{where}")
    first, last = train(engine, data, args.steps, args.micro_batch)
    if rank == 0:
        print(f"loss {first:.3f} -> {last:.3f} over {args.steps} steps")
    report_memory(engine, params, by_tier=args.nvme is not None)
    traffic = gather_rows(SwapTraffic.of(engine).row(), engine) if args.nvme is not None else None
    engine.destroy()  # removes this rank's swap files
    dist.barrier()
    if rank == 0 and traffic is not None:
        report_swap_traffic([SwapTraffic.from_row(t) for t in traffic], args.nvme)
    dist.barrier()
    dist.destroy_process_group()


def train(engine: zcore.Engine, data: torch.Tensor, steps: int, micro_batch: int) -> tuple[float, float]:
    """The loss (mean over ranks) at the first and the last step."""
    rank, world, device = engine.context.rank, engine.context.world_size, engine.context.device
    progress = tqdm(total=steps, disable=rank != 0, unit="step")
    first = last = float("nan")
    for step, (x, y) in zip(range(steps), batches(data, micro_batch, rank, world, seed=1)):
        loss = lm_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        last = mean.item() / world
        first = last if step == 0 else first
        progress.set_postfix(loss=f"{last:.3f}", lr=f"{engine.get_lr()[0]:.1e}")
        progress.update()
    progress.close()
    return first, last


def report_memory(engine: zcore.Engine, params: int, by_tier: bool) -> None:
    """Rank 0 prints its memory report, then each rank's total against DDP's
    (with ``by_tier``, split by where the bytes live)."""
    report = engine.memory_report()
    figures = [report.measured.total, *(report.measured_tiers[t].total for t in TIERS)]
    rows = gather_rows(torch.tensor([float(v) for v in figures], dtype=torch.float64), engine)
    if engine.context.rank != 0:
        return
    ddp = 16 * params  # fp32 Adam under DDP: parameters, gradients, exp_avg, exp_avg_sq
    print(report)
    for r, (total, *tiers) in enumerate(row.tolist() for row in rows):
        split = " (" + ", ".join(f"{t} {v / _MIB:.2f}" for t, v in zip(TIERS, tiers)) + ")" if by_tier else ""
        print(f"rank {r}: {total / _MIB:.2f} MiB held by zcore{split}; DDP would hold {ddp / _MIB:.2f} MiB")


@dataclass(frozen=True)
class SwapTraffic:
    """Bytes one rank moved through its swap files since start-up (the
    initial writes included)."""

    parameters_read: int
    parameters_written: int
    shard_fetches: int  # parameter shards read ahead of their all-gathers
    optimizer_read: int
    optimizer_written: int
    sub_groups: int  # the optimizer's states, each read and written once a step

    @staticmethod
    def of(engine: zcore.Engine) -> SwapTraffic:
        params = engine.residency.parameter_swap_stats()
        master = engine.optimizer.master
        optimizer = master.swap.stats()
        return SwapTraffic(
            parameters_read=params.bytes_swapped_in if params is not None else 0,
            parameters_written=params.bytes_swapped_out if params is not None else 0,
            shard_fetches=engine.gather_stats().shard_fetches,
            optimizer_read=optimizer.bytes_swapped_in,
            optimizer_written=optimizer.bytes_swapped_out,
            sub_groups=len(master.sub_groups),
        )

    def row(self) -> torch.Tensor:
        return torch.tensor([float(v) for v in astuple(self)], dtype=torch.float64)

    @staticmethod
    def from_row(row: torch.Tensor) -> SwapTraffic:
        return SwapTraffic(*(int(v) for v in row.tolist()))


def report_swap_traffic(ranks: list[SwapTraffic], directory: Path) -> None:
    print(f"bytes moved through the swap files under {directory} since start-up, per rank:")
    for r, t in enumerate(ranks):
        print(f"rank {r}: parameters {t.parameters_read / _MIB:.2f} MiB read ({t.shard_fetches} shard fetches), "
              f"{t.parameters_written / _MIB:.2f} MiB written; optimizer states {t.optimizer_read / _MIB:.2f} MiB "
              f"read, {t.optimizer_written / _MIB:.2f} MiB written ({t.sub_groups} sub-group(s))")
    left = sorted(directory.glob("zcore-swap-*"))
    print(f"swap files removed by engine.destroy(): {len(left)} left in {directory}")


def gather_rows(row: torch.Tensor, engine: zcore.Engine) -> list[torch.Tensor]:
    """``row`` of every rank, in rank order (on the CPU)."""
    device = engine.context.device
    gathered = [torch.zeros_like(row, device=device) for _ in range(engine.context.world_size)]
    dist.all_gather(gathered, row.to(device))
    return [g.cpu() for g in gathered]


def exit_now() -> None:
    """Ends the process without interpreter teardown. With torch 2.13 and
    gloo, a process that has used a process group sometimes aborts in static
    teardown after destroy_process_group() ("terminate called without an
    active exception"): measured 3 times in 12 runs of a plain DDP script on
    this 2-core machine under load. Nothing is left to run or flush."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
    exit_now()
