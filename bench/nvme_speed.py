"""ZeRO-Infinity speed (issue 14, benchmark 2): a GPT of about 92M
parameters on 2 gloo ranks with parameters and optimizer states on NVMe,
against zcore stage 3 in RAM and DeepSpeed under the same offload, in one
run. Targets: zcore on NVMe at most 1.15x zcore in RAM, and at most 0.6x
DeepSpeed on NVMe.

    .venv/bin/python bench/nvme_speed.py [--nvme-path build/bench-nvme-speed]
        [--steps 6] [--warmup 2] [--repeats 2] [--systems ...]

Every system trains the same GPT (zcore.demo.gpt: 12 layers, d_model 768,
12 heads, vocab 8192, seq 256, LM head tied: 91.5M parameters) in fp32 with
micro-batch 4 per rank, stage 3, the config's AdamW (lr 1e-4; zcore's
fused CPU Adam, DeepSpeed's DeepSpeedCPUAdam where it offloads), each rank
on one torch thread. Systems:

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
median over the timed steps of all rounds, the range, and each rank's peak
RSS; for zcore, also the bytes each rank moved through its swap files per
step. The targets compare zcore-nvme with zcore-ram and deepspeed-nvme.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import resource
import shutil
import socket
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ["zcore-ram", "zcore-nvme", "deepspeed-nvme", "zcore-nvme-all", "deepspeed-nvme-all"]
MICRO_BATCH = 4
LAYERS, D_MODEL, HEADS = 12, 768, 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(system: str, nvme_dir: Path) -> dict:
    zero: dict = {"stage": 3}
    if "nvme" in system:
        nvme = {"device": "nvme", "nvme_path": str(nvme_dir)}
        zero["offload_param"] = {**nvme, **({"max_in_cpu": 0} if system.endswith("-all") else {})}
        zero["offload_optimizer"] = nvme
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def _swap_bytes(engine) -> int:
    """Bytes this rank moved through its swap files so far (zcore)."""
    stats = [engine.residency.parameter_swap_stats(), engine.optimizer.master.swap.stats(),
             engine.optimizer.reducer.grads.swap.stats()]
    return sum(s.bytes_swapped_in + s.bytes_swapped_out for s in stats if s is not None)


def _rank_main(system, rank, world, port, steps, warmup, nvme_dir, out):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    from zcore.demo.gpt import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(d_model=D_MODEL, n_layers=LAYERS, n_heads=HEADS)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = _config(system, nvme_dir)
    if system.startswith("zcore"):
        import zcore

        engine, *_ = zcore.initialize(model=model, config=config)
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(rank)
    times, moved = [], []
    for _ in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=gen)
        counted = system.startswith("zcore-nvme")
        before = _swap_bytes(engine) if counted else 0
        start = time.perf_counter()
        loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        moved.append(_swap_bytes(engine) - before if counted else 0)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put(pickle.dumps((rank, times[warmup:], moved[warmup:], peak_mib, float(loss.detach()))))
    if system.startswith("zcore"):
        engine.destroy()


def run_system(system: str, steps: int, warmup: int, nvme_root: Path) -> dict:
    nvme_dir = nvme_root / system
    shutil.rmtree(nvme_dir, ignore_errors=True)
    nvme_dir.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(system, r, 2, port, steps, warmup, nvme_dir, out)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, times, moved, peak, loss = pickle.loads(out.get(timeout=3600))
            results[rank] = (times, moved, peak, loss)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(nvme_dir, ignore_errors=True)
    return {
        "step_s": [max(a, b) for a, b in zip(results[0][0], results[1][0])],
        "moved": [statistics.median(results[r][1]) for r in (0, 1)],
        "peak_rss_mib": [results[r][2] for r in (0, 1)],
        "loss": results[0][3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", type=Path, default=ROOT / "build" / "bench-nvme-speed")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds over the systems")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    began = time.perf_counter()
    for round_ in range(args.repeats):
        for system in args.systems:
            runs[system].append(run_system(system, args.steps, args.warmup, args.nvme_path))
            r = runs[system][-1]
            print(f"  round {round_ + 1} {system}: median {statistics.median(r['step_s']):.2f} s/step, "
                  f"loss {r['loss']:.4f} ({time.perf_counter() - began:.0f} s in)", flush=True)

    median = {s: statistics.median(t for r in rs for t in r["step_s"]) for s, rs in runs.items()}
    print(f"\nGPT {LAYERS} layers, d_model {D_MODEL} (91.5M parameters), fp32, stage 3, 2 gloo ranks x 1 thread, "
          f"micro-batch {MICRO_BATCH}; {args.steps} timed steps after {args.warmup} x {args.repeats} round(s)")
    print("| system | step s (median) | range | vs zcore-ram | swap GB/step r0/r1 | peak RSS MiB r0/r1 | last loss |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for system, rs in runs.items():
        steps = [t for r in rs for t in r["step_s"]]
        rel = f"{median[system] / median['zcore-ram']:.2f}x" if "zcore-ram" in median else "-"
        moved = "/".join(f"{statistics.median(r['moved'][i] for r in rs) / 1e9:.2f}" for i in (0, 1))
        rss = "/".join(f"{max(r['peak_rss_mib'][i] for r in rs):.0f}" for i in (0, 1))
        print(f"| {system} | {median[system]:.2f} | {min(steps):.2f}-{max(steps):.2f} | {rel} | "
              f"{moved if system.startswith('zcore-nvme') else '-'} | {rss} | {rs[-1]['loss']:.4f} |")
    if {"zcore-ram", "zcore-nvme"} <= median.keys():
        ratio = median["zcore-nvme"] / median["zcore-ram"]
        print(f"zcore-nvme / zcore-ram = {ratio:.2f}x (target <= 1.15x: {'met' if ratio <= 1.15 else 'NOT met'})")
    if {"deepspeed-nvme", "zcore-nvme"} <= median.keys():
        ratio = median["zcore-nvme"] / median["deepspeed-nvme"]
        print(f"zcore-nvme / deepspeed-nvme = {ratio:.2f}x (target <= 0.6x: {'met' if ratio <= 0.6 else 'NOT met'})")


if __name__ == "__main__":
    main()
