"""Step time and peak memory of ZeRO stages 0-3 on 2 gloo ranks (CPU):
zcore against PyTorch DDP, FSDP2 (fully_shard per block) and DeepSpeed, in
the same run.

Every system trains the same GPT (6 layers, d_model 512, vocab 8192, seq 256,
tied LM head: 23.2M parameters) with micro-batch 4 in fp32, each rank on one
thread, with torch.optim.AdamW as the optimizer (so the systems differ only
in how they shard, reduce and gather). Each system runs in a fresh pair of
processes; the table shows the median step time over the timed steps and
each rank's peak RSS. A system that fails is shown with its error.

    python bench/zero_stages.py [--steps 8] [--warmup 2] [--repeats 1] [--systems ...]

``zcore-N-unchecked`` (not run by default) is zcore at stage N without the
check that the ranks make their calls in step (``out_of_step_check``,
zcore.engine.rank_calls); beside ``zcore-N`` in interleaved rounds it
gives what the check costs per step:

    python bench/zero_stages.py --systems zcore-2 zcore-2-unchecked zcore-3 zcore-3-unchecked --repeats 3
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from _ranks import interleaved_rounds, run_local_ranks

SYSTEMS = [
    "ddp", "fsdp2",
    "zcore-0", "zcore-1", "zcore-2", "zcore-3",
    "deepspeed-0", "deepspeed-1", "deepspeed-2", "deepspeed-3",
]
UNCHECKED = [f"zcore-{stage}-unchecked" for stage in range(4)]
MICRO_BATCH = 4


def _batches(rank: int, steps: int, cfg):
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


def _build(system: str, model, world: int):
    """Returns (forward, backward, step) callables for one system."""
    if system == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        return ddp, lambda loss: loss.backward(), step
    if system == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, lambda loss: loss.backward(), step
    stage = int(system.split("-")[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if system.startswith("zcore"):
        import zcore

        if system.endswith("-unchecked"):
            config["out_of_step_check"] = {"enabled": False}
        engine, *_ = zcore.initialize(model=model, config=config, optimizer=opt)
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=opt)
    return engine, engine.backward, engine.step


def _train(rank: int, world: int, system: str, steps: int, warmup: int) -> tuple[list[float], float, float]:
    """One rank of one system: (timed step times, peak RSS MiB, last loss)."""
    from zcore.demo.gpt import GPT, GPTConfig, lm_loss

    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    forward, backward, step = _build(system, model, world)
    times = []
    for i, (x, y) in enumerate(_batches(rank, warmup + steps, cfg)):
        start = time.perf_counter()
        loss = lm_loss(forward(x), y)
        backward(loss)
        step()
        times.append(time.perf_counter() - start)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return times[warmup:], peak_mib, float(loss.detach())


def run_system(system: str, steps: int, warmup: int) -> dict:
    """One system on 2 fresh ranks: its step times and peak RSS, or {"error": ...}."""
    results = run_local_ranks(_train, 2, system, steps, warmup, timeout=1800)
    if isinstance(results, dict):
        return results
    # A step ends when the slower rank ends it.
    step_times = [max(a, b) for a, b in zip(results[0][0], results[1][0])]
    return {
        "median_ms": 1000 * statistics.median(step_times),
        "min_ms": 1000 * min(step_times),
        "max_ms": 1000 * max(step_times),
        "peak_rss_mib": [results[r][1] for r in (0, 1)],
        "loss": results[0][2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds over all systems")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS + UNCHECKED)
    args = parser.parse_args()

    runs, failed = interleaved_rounds(
        args.systems, args.repeats, lambda system: run_system(system, args.steps, args.warmup),
        lambda r: f"{r['median_ms']:.0f} ms",
    )
    ddp = statistics.median(r["median_ms"] for r in runs["ddp"]) if "ddp" in runs else None
    print(f"\nGPT 23.2M params, fp32, 2 gloo ranks x 1 thread, micro-batch {MICRO_BATCH}, "
          f"{args.steps} timed steps x {args.repeats} round(s)")
    width = max(14, *(len(system) + 2 for system in args.systems))
    print(f"{'system':{width}}{'step ms (median)':>18}{'range':>16}{'vs DDP':>8}{'peak RSS MiB r0/r1':>22}")
    for system, rs in runs.items():
        med = statistics.median(r["median_ms"] for r in rs)
        lo = min(r["min_ms"] for r in rs)
        hi = max(r["max_ms"] for r in rs)
        rel = f"{med / ddp:.2f}x" if ddp else "-"
        rss = "/".join(f"{max(r['peak_rss_mib'][i] for r in rs):.0f}" for i in (0, 1))
        print(f"{system:{width}}{med:>18.0f}{f'{lo:.0f}-{hi:.0f}':>16}{rel:>8}{rss:>22}")
    for system, error in failed.items():
        print(f"{system:{width}}  failed: {error}")


if __name__ == "__main__":
    main()
