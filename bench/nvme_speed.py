"""ZeRO-Infinity speed (issue 14, benchmark 2): a GPT of about 92M
parameters on 2 gloo ranks with parameters and optimizer states on NVMe,
against zcore stage 3 in RAM and DeepSpeed under the same offload, in one
run. Targets: zcore on NVMe at most 1.15x zcore in RAM, and at most 0.6x
DeepSpeed on NVMe.

    .venv/bin/python bench/nvme_speed.py [--nvme-path build/bench-nvme-speed]
        [--micro-batch 4] [--precision fp32] [--steps 6] [--warmup 2]
        [--repeats 2] [--systems ...]

Every system trains the same GPT (zcore.demo.gpt: 12 layers, d_model 768,
12 heads, vocab 8192, seq 256, LM head tied: 91.5M parameters) in fp32 (or
bf16) with micro-batch 4 (or another) per rank, stage 3, the config's
AdamW (lr 1e-4; zcore's fused CPU Adam, DeepSpeed's DeepSpeedCPUAdam where
it offloads), each rank on one torch thread. Systems:

- zcore-ram: stage 3, nothing offloaded (the model is on the CPU device).
- zcore-nvme, deepspeed-nvme: offload_param and offload_optimizer on
  --nvme-path, every other key at the system's default. With the default
  offload_param.max_in_cpu (1e9 elements) both keep this model's parameter
  shards in host memory; the optimizer states (and, in zcore, the
  gradient shards) go to NVMe. DeepSpeed 0.19.8 needed no other setting.
- zcore-nvme-all, deepspeed-nvme-all: the same with max_in_cpu 0, so that
  every parameter shard is on NVMe too.

Each run of a system is a fresh pair of processes; the rounds alternate
the systems. A step ends when the slower rank ends it; the table gives the
median over the timed steps of all rounds, the range, the part of it in
engine.step() (zcore's step with host-resident parameters returns at once
and streams the optimizer states behind the next forward), and each rank's
peak RSS; for zcore, also the bytes each
rank moved through its swap files per step. A system that fails is shown
with its error. The targets compare zcore-nvme with zcore-ram and
deepspeed-nvme.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import time
from pathlib import Path

import torch

from _ranks import interleaved_rounds, run_local_ranks

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ["zcore-ram", "zcore-nvme", "deepspeed-nvme", "zcore-nvme-all", "deepspeed-nvme-all"]
LAYERS, D_MODEL, HEADS = 12, 768, 12
# What DeepSpeed 0.19.8 needs, beyond max_in_cpu 0, to keep every parameter
# shard on NVMe, each found by running without it. bf16: in fp32 its
# swapped-in shards come back in bf16 ("expected m1 and m2 to have the same
# dtype"). Swap buffers for every shard (64 of 4M elements; the largest
# shard, the embedding's, is 3.1M): its shards stay swapped in while
# gathered, and the default 5 buffers run out ("Not enough buffers 0 for
# swapping 1"). No prefetch: its NVMe read-ahead takes the tied embedding
# twice from its trace ("param 132 already assigned swap buffer id 27").
DEEPSPEED_ALL_PARAM = {"buffer_count": 64, "buffer_size": 4_000_000}
DEEPSPEED_ALL_ZERO = {"stage3_prefetch_bucket_size": 0}


def _config(system: str, nvme_dir: Path, micro_batch: int, precision: str) -> dict:
    zero: dict = {"stage": 3}
    if "nvme" in system:
        nvme = {"device": "nvme", "nvme_path": str(nvme_dir)}
        zero["offload_param"] = {**nvme, **({"max_in_cpu": 0} if system.endswith("-all") else {})}
        if system == "deepspeed-nvme-all":
            zero["offload_param"].update(DEEPSPEED_ALL_PARAM)
            zero.update(DEEPSPEED_ALL_ZERO)
        zero["offload_optimizer"] = nvme
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def _swap_bytes(engine) -> int:
    """Bytes this rank moved through its swap files so far (zcore)."""
    stats = [engine.residency.parameter_swap_stats(), engine.optimizer.master.swap.stats(),
             engine.optimizer.reducer.grads.swap.stats()]
    return sum(s.bytes_swapped_in + s.bytes_swapped_out for s in stats if s is not None)


def _train(rank: int, world: int, system: str, args, nvme_dir: Path) -> dict:
    """One rank of one system: its timed steps, bytes swapped, loss and peak RSS."""
    from zcore.demo.gpt import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(d_model=D_MODEL, n_layers=LAYERS, n_heads=HEADS)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = _config(system, nvme_dir, args.micro_batch, args.precision)
    if system.startswith("zcore"):
        import zcore

        engine, *_ = zcore.initialize(model=model, config=config)
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(rank)
    times, step_times, moved = [], [], []
    counted = system.startswith("zcore-nvme")
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len + 1), generator=gen)
        before = _swap_bytes(engine) if counted else 0
        start = time.perf_counter()
        loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        stepping = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        times.append(end - start)
        step_times.append(end - stepping)
        moved.append(_swap_bytes(engine) - before if counted else 0)
    if system.startswith("zcore"):
        engine.destroy()
    w = args.warmup
    return {"times": times[w:], "step_times": step_times[w:], "moved": moved[w:], "loss": float(loss.detach()),
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_system(system: str, args) -> dict:
    nvme_dir = args.nvme_path / system
    shutil.rmtree(nvme_dir, ignore_errors=True)
    nvme_dir.mkdir(parents=True)
    try:
        results = run_local_ranks(_train, 2, system, args, nvme_dir)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    if isinstance(results, dict):  # {"error": ...}: reported in the table; the other systems still run
        return results
    return {
        "step_s": [max(a, b) for a, b in zip(results[0]["times"], results[1]["times"])],
        "in_step_s": [max(a, b) for a, b in zip(results[0]["step_times"], results[1]["step_times"])],
        "moved": [statistics.median(results[r]["moved"]) for r in (0, 1)],
        "peak_rss_mib": [results[r]["peak_mib"] for r in (0, 1)],
        "loss": results[0]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", type=Path, default=ROOT / "build" / "bench-nvme-speed")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds over the systems")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    args = parser.parse_args()

    began = time.perf_counter()
    runs, failed = interleaved_rounds(
        args.systems, args.repeats, lambda system: run_system(system, args),
        lambda r: f"median {statistics.median(r['step_s']):.2f} s/step, loss {r['loss']:.4f} "
                         f"({time.perf_counter() - began:.0f} s in)",
    )
    median = {s: statistics.median(t for r in rs for t in r["step_s"]) for s, rs in runs.items()}
    print(f"\nGPT {LAYERS} layers, d_model {D_MODEL} (91.5M parameters), {args.precision}, stage 3, 2 gloo ranks "
          f"x 1 thread, micro-batch {args.micro_batch}; {args.steps} timed steps after {args.warmup} x "
          f"{args.repeats} round(s)")
    print("| system | step s (median) | range | in engine.step() s | vs zcore-ram | swap GB/step r0/r1 "
          "| peak RSS MiB r0/r1 | last loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for system, rs in runs.items():
        steps = [t for r in rs for t in r["step_s"]]
        in_step = statistics.median(t for r in rs for t in r["in_step_s"])
        rel = f"{median[system] / median['zcore-ram']:.2f}x" if "zcore-ram" in median else "-"
        moved = "/".join(f"{statistics.median(r['moved'][i] for r in rs) / 1e9:.2f}" for i in (0, 1))
        rss = "/".join(f"{max(r['peak_rss_mib'][i] for r in rs):.0f}" for i in (0, 1))
        print(f"| {system} | {median[system]:.2f} | {min(steps):.2f}-{max(steps):.2f} | {in_step:.2f} | {rel} | "
              f"{moved if system.startswith('zcore-nvme') else '-'} | {rss} | {rs[-1]['loss']:.4f} |")
    for system, error in failed.items():
        print(f"| {system} | failed: {error} | | | | | | |")
    if {"zcore-ram", "zcore-nvme"} <= median.keys():
        ratio = median["zcore-nvme"] / median["zcore-ram"]
        print(f"zcore-nvme / zcore-ram = {ratio:.2f}x (target <= 1.15x: {'met' if ratio <= 1.15 else 'NOT met'})")
    if {"deepspeed-nvme", "zcore-nvme"} <= median.keys():
        ratio = median["zcore-nvme"] / median["deepspeed-nvme"]
        print(f"zcore-nvme / deepspeed-nvme = {ratio:.2f}x (target <= 0.6x: {'met' if ratio <= 0.6 else 'NOT met'})")


if __name__ == "__main__":
    main()
