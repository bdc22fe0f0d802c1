"""ZeRO++'s quantized collectives (issue 19): the ZeRO-3 GPT on 2 and 4
gloo ranks, plain stage 3 against qwZ (``zero_quantized_weights``), qgZ
(``zero_quantized_gradients``) and both, in one run; optionally DeepSpeed
0.19.8 with the same keys.

    .venv/bin/python bench/zero_quantized.py [--worlds 2 4] [--steps 6] [--warmup 2]
        [--micro-batch 4] [--precision fp32] [--deepspeed]

The GPT is zcore.demo.gpt's default (23.2M parameters, as
bench/zero_stages.py), each rank on one torch thread. Ranks join the
process group through zcore.counting_group, which runs gloo and counts the
bytes each rank sends, by operation; zcore takes the same paths on it as on
gloo. Per step: the slower rank's step time, the bytes rank 0 sent (all
kinds), and the time rank 0's training thread was blocked on collectives
(step metrics' comm_wait, with wall_clock_breakdown on and its log
silenced). Medians over the timed steps. Targets: communication time at
least 2x lower with qwZ+qgZ than plain, and a lower step time.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import time

import torch

MODES = {"plain": (False, False), "qwZ": (True, False), "qgZ": (False, True), "qwZ+qgZ": (True, True)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(args, weights: bool, gradients: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "bf16": {"enabled": args.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "zero_quantized_weights": weights, "zero_quantized_gradients": gradients},
        "wall_clock_breakdown": True,
    }


def _train(system: str, mode: str, rank: int, world: int, port: int, args) -> dict:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    from zcore import counting_group
    from zcore.demo.gpt import GPT, GPTConfig, lm_loss

    logging.getLogger("zcore.steps").addHandler(logging.NullHandler())
    logging.getLogger("zcore.steps").propagate = False
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    config = _config(args, *MODES[mode])
    if system == "zcore":
        import zcore

        counting_group.init_process_group()
        engine, *_ = zcore.initialize(model=model, config=config)
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(rank)
    times, sent, waited = [], [], []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len + 1), generator=gen)
        if system == "zcore":
            counting_group.reset()
        start = time.perf_counter()
        loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        if system == "zcore":  # DeepSpeed runs on plain gloo, without zcore's step metrics
            sent.append(float(sum(counting_group.counters().values())))
            waited.append(engine.last_step_metrics.time_ms["comm_wait"] / 1e3)
    if system == "zcore":
        engine.destroy()
    w = args.warmup
    return {"times": times[w:], "sent": sent[w:], "waited": waited[w:], "loss": float(loss.detach())}


def _rank_main(system, mode, rank, world, port, args, out):
    try:
        out.put(pickle.dumps((rank, _train(system, mode, rank, world, port, args))))
    except Exception as exc:  # reported in the table; the other runs go on
        out.put(pickle.dumps((rank, {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})))


def run(system: str, mode: str, world: int, args) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(system, mode, r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, result = pickle.loads(out.get(timeout=1800))
            if "error" in result:
                return result
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    step = [max(r["times"][i] for r in results.values()) for i in range(args.steps)]
    if system != "zcore":
        return {"step_s": statistics.median(step), "loss": results[0]["loss"]}
    return {
        "step_s": statistics.median(step),
        "sent_mb": statistics.median(results[0]["sent"]) / 1e6,
        "comm_s": statistics.median(results[0]["waited"]),
        "loss": results[0]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--deepspeed", action="store_true", help="also DeepSpeed 0.19.8 with qwZ+qgZ on 2 ranks")
    args = parser.parse_args()
    print(f"GPT 23.2M parameters, stage 3, {args.precision}, micro-batch {args.micro_batch} per rank, "
          f"{args.steps} timed steps after {args.warmup}")
    print("| world | mode | step s | vs plain | MB sent per step (rank 0) | comm wait s (rank 0) | vs plain | loss |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for world in args.worlds:
        plain = None
        for mode in MODES:
            r = run("zcore", mode, world, args)
            if "error" in r:
                print(f"| {world} | {mode} | failed: {r['error']} |")
                continue
            plain = plain or r
            print(f"| {world} | {mode} | {r['step_s']:.3f} | {r['step_s'] / plain['step_s']:.2f}x | "
                  f"{r['sent_mb']:.1f} | {r['comm_s']:.3f} | {r['comm_s'] / plain['comm_s']:.2f}x | "
                  f"{r['loss']:.4f} |", flush=True)
    if args.deepspeed:
        r = run("deepspeed", "qwZ+qgZ", 2, args)
        outcome = r["error"] if "error" in r else f"step {r['step_s']:.3f} s"
        print(f"DeepSpeed 0.19.8, stage 3 with zero_quantized_weights and zero_quantized_gradients, 2 ranks: {outcome}")


if __name__ == "__main__":
    main()
