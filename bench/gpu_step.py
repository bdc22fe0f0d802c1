"""One training step of a ~355M-parameter GPT on one GPU: plain torch, torch
FSDP2 and zcore stage 3 (optimizer on the device, and on the host with
zcore's CPU Adam), measured in the same run.

The model is zcore's demo GPT (python/zcore/demo/gpt.py) at GPT-2 medium's
shape: 24 layers, d_model 1024, 16 heads, vocab 50304, seq 1024, LM head
tied to the token embedding: 354.8M parameters. Micro-batch 8 (about 8.2k
tokens a step); every config trains the same initial weights on the same
token batches, with AdamW (lr 1e-4, weight decay 0.01, torch's default
implementation, foreach on CUDA, wherever torch's optimizer runs) and no
gradient clipping:

  torch            fp32 parameters, forward under torch.autocast(bf16),
                   torch.optim.AdamW on the fp32 parameters (the usual torch
                   recipe: fp32 weights, grads and Adam states, 16 B/param).
  fsdp2            fully_shard per block, then the root, MixedPrecisionPolicy
                   (param_dtype bf16, reduce_dtype fp32), world 1 on NCCL;
                   torch.optim.AdamW on the fp32 sharded parameters.
  zcore-3          zcore.initialize, ZeRO stage 3, bf16 on (bf16 compute
                   parameters, fp32 master shards and Adam states), DeepSpeed's
                   stage-3 defaults; the config's AdamW section, from which
                   zcore builds torch.optim.AdamW over the master shards on the
                   device.
  zcore-3-offload  as zcore-3 with zero_optimization.offload_optimizer
                   {device: cpu, pin_memory: true}: fp32 master and states
                   in page-locked host memory, stepped by zcore's fused CPU
                   Adam (zcore.optim.CPUAdam, all the host's cores).

Each config runs in a fresh process (so that one config's caches, threads
and pinned memory cannot touch the next one's figures), one after another:
--warmup steps, then --steps timed steps, each step timed from a
torch.cuda.synchronize() to the next (forward, backward, optimizer step and
the loss's .item()); the table shows the median. Memory: the peak of
torch.cuda.max_memory_allocated over the timed steps (reset after warm-up),
and over the whole config (model build and engine set-up included), and the
memory allocated between steps (what stays resident), beside which the zcore
configs print their own memory_report's device figures at the same moment;
the host's peak RSS. zcore-3-offload also prints its last step's split by
phase (wall_clock_breakdown: host wall time of forward, backward, the
optimizer step and the waits).
"loss" is the last step's, a check that every config trains the same model.

The table is printed as markdown; the last line is ``BENCH_JSON {...}`` (every
figure, for scripts/gpu_report.py). A config that fails, or is still running
when --budget-s seconds (all configs together) are spent, gets a row with
its error and the exit status is 1; one that the budget leaves under 10 s to
start (5 s with --tiny) is skipped, which is not a failure.

    python bench/gpu_step.py [--steps 5] [--warmup 3] [--micro-batch 8] [--budget-s 85]
    python bench/gpu_step.py --tiny     # CPU, gloo, a 0.1M-parameter GPT: the same code path in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

CONFIGS = ["torch", "fsdp2", "zcore-3", "zcore-3-offload"]
LR, WEIGHT_DECAY = 1e-4, 0.01
GIB = 1 << 30
RESULT = "RESULT "  # a child's last line: RESULT {json}


def model_config(tiny: bool):
    from zcore.demo.gpt import GPTConfig

    if tiny:
        return GPTConfig(vocab_size=512, seq_len=64, d_model=64, n_layers=2, n_heads=4)
    return GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=24, n_heads=16)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny GPT, gloo, device cpu")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 8; --tiny 2)")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--budget-s", type=float, default=85.0, help="all configs together; later ones skip")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.tiny else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.micro_batch = args.micro_batch or (2 if args.tiny else 8)
    return args


# ------------------------------------------------------------------ child --


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init_world_of_one(device: torch.device) -> None:
    """The default process group, rank 0 of 1: NCCL for a GPU, gloo for the CPU."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def build_step(config: str, model: torch.nn.Module, device: torch.device, micro_batch: int):
    """A function (tokens, targets) -> loss that runs one whole training step."""
    from zcore.demo.gpt import lm_loss

    if config == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

        def step(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(x)
            loss = lm_loss(logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step
    init_world_of_one(device)
    if config == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

        def step(x, y):
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step
    import zcore

    offload = {"device": "cpu", "pin_memory": True} if config == "zcore-3-offload" else {"device": "none"}
    engine, *_ = zcore.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": 3, "offload_optimizer": offload},
        # The offload step's split (host wall time per phase, zcore.observe.step_metrics):
        # under 1% of a step on the CPU (bench/RESULTS.md), a 370 ms step here.
        "wall_clock_breakdown": config == "zcore-3-offload",
        "steps_per_print": 10**9,
    })
    if engine.context.device != device:
        raise RuntimeError(f"zcore runs on {engine.context.device}, the benchmark on {device}")

    def step(x, y):
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    step.engine = engine  # its memory_report, beside the allocator's figures
    return step


def child(config: str, args: argparse.Namespace) -> dict:
    """One config, in this process: its figures."""
    from zcore.demo.gpt import GPT

    if args.tiny:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # a smoke run; a shared 2-core machine is faster so
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no usable GPU (torch.cuda.is_available() is False); --tiny runs on the CPU")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    cfg = model_config(args.tiny)
    gen = torch.Generator().manual_seed(1234)
    batches = [
        torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len + 1), generator=gen)
        for _ in range(args.warmup + args.steps)
    ]
    batches = [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in batches]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    t_setup = time.perf_counter()
    step = build_step(config, model, device, args.micro_batch)
    setup_s = time.perf_counter() - t_setup
    times, losses, resident, peak_before, reported = [], [], 0, 0, None
    for i, (x, y) in enumerate(batches):
        if i == args.warmup and getattr(step, "engine", None) is not None:
            from zcore.observe.memory_report import DEVICE

            figures = step.engine.memory_report().measured_tiers[DEVICE]
            reported = {k: round(v / GIB, 3) for k, v in vars(figures).items()} | {
                "total": round(figures.total / GIB, 3)
            }
        if i == args.warmup and device.type == "cuda":
            sync(device)
            resident = torch.cuda.memory_allocated(device)
            peak_before = torch.cuda.max_memory_allocated(device)  # set-up and warm-up
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        loss = float(step(x, y).detach())
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss)
    peak_steps = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    metrics = getattr(getattr(step, "engine", None), "last_step_metrics", None)
    return {
        "config": config,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": params,
        "tokens_per_step": args.micro_batch * cfg.seq_len,
        "setup_s": round(setup_s, 3),
        "step_ms": [round(t * 1e3, 3) for t in times],
        "median_ms": round(1e3 * statistics.median(times), 3),
        "losses": losses,
        "loss": losses[-1],
        "resident_gib": round(resident / GIB, 3) if device.type == "cuda" else None,
        "zcore_reported_device_gib": reported,  # zcore's memory_report, when resident was read
        "last_step_split_ms": None if metrics is None else {k: round(v, 2) for k, v in metrics.time_ms.items()},
        "peak_steps_gib": round(peak_steps / GIB, 3) if device.type == "cuda" else None,
        "peak_all_gib": round(max(peak_before, peak_steps) / GIB, 3) if device.type == "cuda" else None,
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), 3),
    }


def child_main(config: str, args: argparse.Namespace) -> int:
    try:
        result = child(config, args)
    except Exception as exc:  # noqa: BLE001 - reported in the table; the other configs go on
        traceback.print_exc()
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        result = {"config": config, "error": f"{type(exc).__name__}: {first}"}
    print(RESULT + json.dumps(result), flush=True)
    return 0


# ----------------------------------------------------------------- parent --


def run_child(config: str, args: argparse.Namespace, timeout: float) -> dict:
    """``config`` in a fresh process; its output goes on to ours, prefixed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", config, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch)]
    if args.tiny:
        cmd.append("--tiny")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a world of one with an in-memory store, whatever launched us
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    found: list[dict] = []

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(RESULT):
                found.append(json.loads(line[len(RESULT):]))
            else:
                print(f"  [{config}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(timeout=5)
        return {"config": config, "error": f"killed: not done within the {timeout:.0f} s left of the budget"}
    reader.join(timeout=10)
    if found:
        return found[-1]
    return {"config": config, "error": f"the process exited with code {code} and no result"}


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    args = parse_args()
    if args.child:
        return child_main(args.child, args)
    deadline = time.monotonic() + args.budget_s
    cfg = model_config(args.tiny)
    # Not a CUDA call beyond the device count: the children's contexts alone hold device memory.
    if not args.tiny and not torch.cuda.is_available():
        print("fail: gpu_step needs a GPU: torch sees none (torch.cuda.is_available() is False); "
              "--tiny runs on the CPU")
        return 1
    where = "CPU (gloo), --tiny smoke run" if args.tiny else "GPU 0"
    print(f"gpu_step: {len(args.configs)} configs, each in a fresh process, on {where}; "
          f"{args.warmup} warm-up + {args.steps} timed steps, micro-batch {args.micro_batch} x seq {cfg.seq_len}, "
          f"budget {args.budget_s:.0f} s", flush=True)
    results = []
    for config in args.configs:
        left = deadline - time.monotonic()
        if left < (5 if args.tiny else 10):
            results.append({"config": config, "skipped": f"not started: {left:.0f} s of the "
                                                          f"{args.budget_s:.0f} s budget left"})
            print(f"  {config}: {results[-1]['skipped']}", flush=True)
            continue
        t0 = time.monotonic()
        result = run_child(config, args, left)
        result["wall_s"] = round(time.monotonic() - t0, 1)
        results.append(result)
        print(f"  {config}: " + (result["error"] if "error" in result else
                                 f"{result['median_ms']:.1f} ms/step, loss {result['loss']:.4f}, "
                                 f"{result['wall_s']:.0f} s in all"), flush=True)

    ok = [r for r in results if "error" not in r and "skipped" not in r]
    if ok and not args.tiny:
        where = ok[0]["device"]
    params = ok[0]["params"] if ok else None
    size = "?" if params is None else f"{params / 1e6:.3f}M" if args.tiny else f"{params / 1e6:.1f}M"
    base = next((r["median_ms"] for r in ok if r["config"] == "torch"), None)
    print()
    if args.tiny:
        print(f"GPT {size} params (--tiny), seq {cfg.seq_len}, micro-batch "
              f"{args.micro_batch}, CPU; median of {args.steps} steps (a smoke run: the figures mean nothing)")
    else:
        print(f"GPT {size} params, seq {cfg.seq_len}, micro-batch "
              f"{args.micro_batch}, bf16, world 1 (NCCL for fsdp2 and zcore), {where}; "
              f"median of {args.steps} steps after {args.warmup} warm-up")
    print("| config | step ms (median) | vs torch | tokens/s | peak GiB (steps) | peak GiB (all) "
          "| resident GiB | host RSS GiB | setup s | loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        if "error" in r or "skipped" in r:
            what = f"failed: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            print(f"| {r['config']} | {what.replace('|', '/')} | | | | | | | | |")
            continue
        rel = f"{r['median_ms'] / base:.2f}x" if base else "-"
        tps = r["tokens_per_step"] / (r["median_ms"] / 1e3)
        print(f"| {r['config']} | {r['median_ms']:.1f} | {rel} | {tps:,.0f} | {fmt(r['peak_steps_gib'])} "
              f"| {fmt(r['peak_all_gib'])} | {fmt(r['resident_gib'])} | {r['host_peak_rss_gib']:.2f} "
              f"| {r['setup_s']:.1f} | {r['loss']:.4f} |")
    for r in results:
        if r.get("last_step_split_ms"):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["last_step_split_ms"].items())
            print(f"{r['config']}: the last step's split (host wall time), ms: {parts}")
        if r.get("zcore_reported_device_gib"):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r["zcore_reported_device_gib"].items())
            print(f"{r['config']}: memory_report on the device between steps, GiB: {parts} "
                  f"(allocator: {fmt(r['resident_gib'])})")
    summary = {
        "bench": "gpu_step",
        "tiny": args.tiny,
        "device": where,
        "model": {"params": params, "seq": cfg.seq_len, "d_model": cfg.d_model, "layers": cfg.n_layers,
                  "vocab": cfg.vocab_size},
        "micro_batch": args.micro_batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "results": results,
    }
    print("BENCH_JSON " + json.dumps(summary), flush=True)
    # A config that failed (or ran past the budget) fails the run; one not started for want of time does not.
    return 1 if not ok or any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
