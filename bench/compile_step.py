"""Step time of torch.compile under ZeRO-3 (CPU, 2 gloo ranks; or one GPU):
zcore stage 3 against FSDP2 (``fully_shard`` per block and the root) and
DDP, each eager and compiled, in the same run.

Every system trains the demo GPT (6 layers, d_model 512, vocab 8192, seq
256, tied LM head) with micro-batch 4 in fp32 (or, with ``--precision
bf16``, computing in bf16 over fp32 weights: zcore's bf16, FSDP2's
MixedPrecisionPolicy, DDP under torch.autocast), each rank on one thread,
with torch.optim.AdamW. Compiled: zcore's ``engine.compile()`` (each block
compiled, gathered as one unit), FSDP2's blocks compiled after
``fully_shard`` (``block.compile()``, as torchtitan does), DDP's model
``torch.compile``d whole. Each run is a fresh set of processes; systems run
in interleaved rounds. The table shows the median step time over the timed
steps, and for compiled systems the first step (Dynamo and inductor
compiling): in round 1 with an empty inductor cache, in later rounds with
the cache the first round left (warm).

    python bench/compile_step.py [--steps 8] [--warmup 3] [--repeats 2] [--systems ...]
    python bench/compile_step.py --device cuda --world 1    # on a lent GPU
    python bench/compile_step.py --tiny --steps 2 --repeats 1 # a 4-block d_model 64 GPT: does it run
    python bench/compile_step.py --precision bf16              # bf16 compute (AMX or AVX-512 bf16 matmuls)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from _ranks import interleaved_rounds, run_local_ranks

SYSTEMS = ["ddp", "ddp-compiled", "fsdp2", "fsdp2-compiled", "zcore-3", "zcore-3-compiled"]
MICRO_BATCH = 4


def _build(system: str, model, device: str, precision: str):
    """Returns (forward, backward, step) callables for one system."""

    compiled = system.endswith("-compiled")
    bf16 = precision == "bf16"
    if system.startswith("zcore"):
        import zcore

        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        config = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16},
        }
        engine, *_ = zcore.initialize(model=model, config=config, optimizer=opt)
        if compiled:
            engine.compile()
        return engine, engine.backward, engine.step
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    model.to(device)
    if system.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
            if compiled:
                block.compile()
        fully_shard(model, mp_policy=policy)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        if compiled:
            wrapped = torch.compile(wrapped)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16 and not system.startswith("fsdp2")):
            return wrapped(tokens)

    return forward, lambda loss: loss.backward(), step


def _config(tiny: bool):
    from zcore.demo.gpt import GPTConfig

    return GPTConfig(vocab_size=512, seq_len=32, d_model=64, n_layers=4, n_heads=4) if tiny else GPTConfig()


def _train(
    rank: int, world: int, system: str, steps: int, warmup: int, device: str, tiny: bool, precision: str
) -> tuple[list[float], float]:
    """One rank of one system: (every step's time, last loss)."""
    from zcore.demo.gpt import GPT, lm_loss

    if device == "cuda":
        torch.cuda.set_device(rank)
    cfg = _config(tiny)
    torch.manual_seed(0)
    model = GPT(cfg)
    forward, backward, step = _build(system, model, device, precision)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=gen).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = lm_loss(forward(tokens[:, :-1]), tokens[:, 1:])
        backward(loss)
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    last = float(loss.detach())
    dist.destroy_process_group()  # NCCL warns of leaked resources otherwise
    return times, last


def run_system(
    system: str, steps: int, warmup: int, device: str, world: int, cache: str, tiny: bool, precision: str
) -> dict:
    """One system on fresh ranks: its step times, or {"error": ...}."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, system)  # the ranks inherit it
    results = run_local_ranks(_train, world, system, steps, warmup, device, tiny, precision, timeout=3600)
    if isinstance(results, dict):
        return results
    # A step ends when the slowest rank ends it.
    times = [max(ts) for ts in zip(*(r[0] for r in results))]
    timed = times[warmup:]
    return {
        "median_ms": 1000 * statistics.median(timed),
        "min_ms": 1000 * min(timed),
        "max_ms": 1000 * max(timed),
        "first_s": times[0],
        "loss": results[0][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds (round 2 on: warm cache)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT, to check that the benchmark runs")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    world = args.world or (2 if args.device == "cpu" else 1)

    with tempfile.TemporaryDirectory(prefix="zcore-compile-cache-") as cache:
        runs, failed = interleaved_rounds(
            args.systems, args.repeats,
            lambda system: run_system(
                system, args.steps, args.warmup, args.device, world, cache, args.tiny, args.precision
            ),
            lambda r: f"{r['median_ms']:.0f} ms, first step {r['first_s']:.1f} s",
        )
    median = {s: statistics.median(r["median_ms"] for r in rs) for s, rs in runs.items()}
    print(f"\nGPT {_param_count(args.tiny) / 1e6:.1f}M params, {args.precision}, {world} rank(s) on {args.device}, micro-batch "
          f"{MICRO_BATCH}, {args.steps} timed steps x {args.repeats} round(s)")
    print(f"{'system':18}{'step ms (median)':>18}{'range':>14}{'vs eager':>10}{'vs fsdp2-c':>12}"
          f"{'1st step s cold':>17}{'warm':>7}")
    for system, rs in runs.items():
        lo, hi = min(r["min_ms"] for r in rs), max(r["max_ms"] for r in rs)
        eager = median.get(system.removesuffix("-compiled"))
        vs_eager = f"{median[system] / eager:.2f}x" if eager and system.endswith("-compiled") else "-"
        fsdp = median.get("fsdp2-compiled")
        vs_fsdp = f"{median[system] / fsdp:.2f}x" if fsdp else "-"
        cold = f"{rs[0]['first_s']:.1f}"
        warm = f"{statistics.median(r['first_s'] for r in rs[1:]):.1f}" if len(rs) > 1 else "-"
        print(f"{system:18}{median[system]:>18.0f}{f'{lo:.0f}-{hi:.0f}':>14}{vs_eager:>10}{vs_fsdp:>12}"
              f"{cold:>17}{warm:>7}")
    for system, error in failed.items():
        print(f"{system:18}  failed: {error}")


def _param_count(tiny: bool) -> int:
    from zcore.demo.gpt import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(_config(tiny)).parameters())


if __name__ == "__main__":
    main()
