"""3D parallelism at world 8 on one machine: 2 pipeline stages x 2
data-parallel ranks x 2 tensor-parallel ranks (gloo, one thread per rank),
zcore at ZeRO stages 1-3 against torch's own composition in the same run:
FSDP2 (``fully_shard`` over "dp", resharding after forward: ZeRO-3) under
the same tensor parallelism and the same ``torch.distributed.pipelining``
1F1B schedule.

Every system trains the same GPT (untied LM head, each block's MLP split
Megatron-style over "tp"), cut into two stages of equal blocks, from the
same initial weights on the same batches, with AdamW at the same settings;
2 micro-batches of 2 rows per dp rank per step. The table shows the median
step time (a step ends when the slowest rank ends it), the worst peak RSS
of a rank, and how far each zcore run's losses are from torch's over the
same steps (the same arithmetic up to the order of the sums).

    python bench/parallel_3d.py [--steps 10] [--warmup 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from _ranks import interleaved_rounds, run_local_ranks

SYSTEMS = ["torch-fsdp2", "zcore-1", "zcore-2", "zcore-3"]
PP, DP, TP = 2, 2, 2
MICRO_BATCHES, ROWS = 2, 2
LR = 1e-3


def _config():
    from zcore.demo.gpt import GPTConfig

    return GPTConfig(vocab_size=4096, seq_len=128, d_model=256, n_layers=4, n_heads=4)


class _Stage(torch.nn.Module):
    """Blocks ``first``..``last`` of the GPT, with the embeddings on the first
    stage and the final norm and head on the last, named as in the whole model."""

    def __init__(self, gpt, stage: int) -> None:
        super().__init__()
        half = len(gpt.blocks) // PP
        self.first, self.last = stage == 0, stage == PP - 1
        self.blocks = torch.nn.ModuleDict({str(i): gpt.blocks[i] for i in range(stage * half, (stage + 1) * half)})
        if self.first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _stage_module(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from zcore.demo.gpt import GPT

    torch.manual_seed(0)
    gpt = GPT(_config())
    gpt.lm_head.weight = torch.nn.Parameter(gpt.wte.weight.detach().clone())  # untied: one per stage
    module = _Stage(gpt, mesh["pp"].get_local_rank())
    plan = {}
    for name in module.blocks:
        plan[f"blocks.{name}.c_fc"] = ColwiseParallel()
        plan[f"blocks.{name}.c_out"] = RowwiseParallel()
    return parallelize_module(module, mesh["tp"], plan)


def _build(system: str, mesh):
    """(schedule, step after each schedule step)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from zcore.demo.gpt import lm_loss

    module = _stage_module(mesh)
    stage, stages = mesh["pp"].get_local_rank(), PP
    if system == "torch-fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in module.blocks.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        opt = torch.optim.AdamW(module.parameters(), lr=LR)
        pipe = PipelineStage(module, stage, stages, torch.device("cpu"), group=mesh["pp"].get_group())

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Schedule1F1B(pipe, n_microbatches=MICRO_BATCHES, loss_fn=lm_loss), step
    import zcore
    from zcore.parallel.pipelining import PipelineStage as ZcorePipelineStage

    config = {
        "train_batch_size": DP * MICRO_BATCHES * ROWS,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": int(system.split("-")[1])},
    }
    engine, *_ = zcore.initialize(model=module, config=config, device_mesh=mesh)
    schedule = Schedule1F1B(ZcorePipelineStage(engine, stage, stages), n_microbatches=MICRO_BATCHES, loss_fn=lm_loss)
    return schedule, lambda: None  # the engine steps inside the schedule


def _train(rank: int, world: int, system: str, steps: int) -> tuple[list[float], list[float], float]:
    """One rank: (step times, mean losses, peak RSS MiB)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    schedule, step = _build(system, mesh)
    stage, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    cfg = _config()
    gen = torch.Generator().manual_seed(0)
    times, losses = [], []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (DP, MICRO_BATCHES * ROWS, cfg.seq_len + 1), generator=gen)
        x, y = tokens[dp, :, :-1], tokens[dp, :, 1:]
        dist.barrier()
        start = time.perf_counter()
        micro: list = []
        if stage == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=micro)
        step()
        times.append(time.perf_counter() - start)
        total = torch.stack(micro).sum().detach() if micro else torch.zeros(())
        dist.all_reduce(total)  # the last stage's dp and tp ranks
        losses.append(total.item() / (DP * TP * MICRO_BATCHES))
    return times, losses, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_system(system: str, steps: int, warmup: int) -> dict:
    results = run_local_ranks(_train, PP * DP * TP, system, warmup + steps, timeout=1800)
    if isinstance(results, dict):
        return results
    step_times = [max(r[0][i] for r in results) for i in range(warmup, warmup + steps)]
    return {
        "median_ms": 1000 * statistics.median(step_times),
        "losses": results[0][1],
        "peak_rss_mib": max(r[2] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds over all systems")
    args = parser.parse_args()

    runs, failed = interleaved_rounds(
        SYSTEMS, args.repeats, lambda system: run_system(system, args.steps, args.warmup),
        lambda r: f"{r['median_ms']:.0f} ms",
    )
    from zcore.demo.gpt import GPT

    cfg = _config()
    params = sum(p.numel() for p in GPT(cfg).parameters()) + cfg.vocab_size * cfg.d_model  # and the untied head
    torch_ms = statistics.median(r["median_ms"] for r in runs["torch-fsdp2"]) if "torch-fsdp2" in runs else None
    reference = runs["torch-fsdp2"][0]["losses"] if "torch-fsdp2" in runs else None
    print(f"\nGPT {params / 1e6:.1f}M params (untied head), fp32, world 8 = {PP} pp x {DP} dp x {TP} tp, "
          f"gloo, 1 thread per rank, {MICRO_BATCHES} micro-batches x {ROWS} rows per dp rank, 1F1B, "
          f"{args.steps} timed steps x {args.repeats} round(s)")
    print(f"{'system':14}{'step ms (median)':>18}{'vs torch':>10}{'peak RSS MiB':>14}{'max loss gap vs torch':>24}")
    for system, rs in runs.items():
        med = statistics.median(r["median_ms"] for r in rs)
        rel = f"{med / torch_ms:.2f}x" if torch_ms else "-"
        gap = "-"
        if reference is not None and system != "torch-fsdp2":
            gap = f"{max(abs(a - b) / abs(b) for a, b in zip(rs[0]['losses'], reference)):.1e}"
        print(f"{system:14}{med:>18.0f}{rel:>10}{max(r['peak_rss_mib'] for r in rs):>14.0f}{gap:>24}")
    for system, error in failed.items():
        print(f"{system:14}  failed: {error}")


if __name__ == "__main__":
    main()
