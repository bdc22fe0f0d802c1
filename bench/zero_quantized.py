"""Fewer bytes on the wire (issue 19): the GPT on 2 and 4 gloo ranks, plain
ZeRO-3 against each mode in one run: qwZ (``zero_quantized_weights``), qgZ
(``zero_quantized_gradients``), both, hpZ (``zero_hpz_partition_size``),
all three (ZeRO++), MiCS (``mics_shard_size``), and at stage 0 Adam against
1-bit Adam past its warm-up; optionally DeepSpeed 0.19.8 with qwZ+qgZ.

    .venv/bin/python bench/zero_quantized.py [--worlds 2 4] [--local-world 2] [--steps 6]
        [--warmup 2] [--micro-batch 4] [--precision fp32] [--deepspeed]

Ranks form nodes of ``--local-world`` (LOCAL_WORLD_SIZE, as torchrun sets
it): 4 ranks are 2 nodes x 2, so hpZ and MiCS use blocks of 2 and qgZ
reduces in two levels; modes that need two nodes are skipped where the
world is one node. One machine has no slower link between "nodes": what
the hierarchy saves shows in the bytes crossing nodes, not in time.

The GPT is zcore.demo.gpt's default (23.2M parameters, as
bench/zero_stages.py), each rank on one torch thread. Ranks join through
zcore.comm.counting_group, which runs gloo and counts the bytes each rank sends,
to which peer, on every process group. Per step: the slower rank's step
time, the bytes rank 0 sent on all groups and those to ranks of another
node, and the time rank 0's training thread was blocked on collectives
(step metrics' comm_wait, with wall_clock_breakdown on and its log
silenced). Medians over the timed steps. Targets: communication time at
least 2x lower with qwZ+qgZ than plain, and a lower step time.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from _ranks import run_local_ranks

STAGE3 = {
    "plain": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    "hpZ": {"zero_hpz_partition_size": "local"},
    "qwZ+qgZ+hpZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                    "zero_hpz_partition_size": "local"},
    "MiCS": {"mics_shard_size": "local"},
}
ONE_BIT = {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 1}}  # compressed from the second step
MODES = [*((m, 3) for m in STAGE3), ("stage 0 Adam", 0), ("stage 0 1-bit Adam", 0)]


def _config(args, mode: str, stage: int) -> dict:
    zero: dict = {"stage": stage}
    for key, value in STAGE3.get(mode, {}).items():
        zero[key] = args.local_world if value == "local" else value
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "bf16": {"enabled": args.precision == "bf16"},
        "optimizer": ONE_BIT if mode == "stage 0 1-bit Adam" else {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "wall_clock_breakdown": True,
    }


def _train(rank: int, world: int, system: str, mode: str, stage: int, args) -> dict:
    from zcore.comm import counting_group
    from zcore.demo.gpt import GPT, GPTConfig, lm_loss

    logging.getLogger("zcore.steps").addHandler(logging.NullHandler())
    logging.getLogger("zcore.steps").propagate = False
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    config = _config(args, mode, stage)
    if system == "zcore":
        import zcore

        counting_group.init_process_group()
        engine, *_ = zcore.initialize(model=model, config=config)
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(rank)
    node = rank // args.local_world
    times, sent, across, waited = [], [], [], []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len + 1), generator=gen)
        if system == "zcore":
            counting_group.reset_all()
        start = time.perf_counter()
        loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        if system == "zcore":  # DeepSpeed runs on plain gloo, without zcore's step metrics
            to_peer = counting_group.peer_bytes_on_every_group()
            sent.append(float(sum(to_peer.values())))
            across.append(float(sum(b for peer, b in to_peer.items() if peer // args.local_world != node)))
            waited.append(engine.last_step_metrics.time_ms["comm_wait"] / 1e3)
    if system == "zcore":
        engine.destroy()
    w = args.warmup
    return {"times": times[w:], "sent": sent[w:], "across": across[w:], "waited": waited[w:],
            "loss": float(loss.detach())}


def run(system: str, mode: str, stage: int, world: int, args) -> dict:
    results = run_local_ranks(_train, world, system, mode, stage, args, local_world=args.local_world, timeout=1800)
    if isinstance(results, dict):
        return results
    step = [max(r["times"][i] for r in results) for i in range(args.steps)]
    if system != "zcore":
        return {"step_s": statistics.median(step), "loss": results[0]["loss"]}
    return {
        "step_s": statistics.median(step),
        "sent_mb": statistics.median(results[0]["sent"]) / 1e6,
        "across_mb": statistics.median(results[0]["across"]) / 1e6,
        "comm_s": statistics.median(results[0]["waited"]),
        "loss": results[0]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--local-world", type=int, default=2, help="ranks per node (LOCAL_WORLD_SIZE)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--deepspeed", action="store_true", help="also DeepSpeed 0.19.8 with qwZ+qgZ on 2 ranks")
    args = parser.parse_args()
    print(f"GPT 23.2M parameters, {args.precision}, micro-batch {args.micro_batch} per rank, nodes of "
          f"{args.local_world} ranks, {args.steps} timed steps after {args.warmup}")
    print("| world | mode | step s | vs plain | MB sent per step (rank 0) | MB to other nodes | comm wait s (rank 0) "
          "| vs plain | loss |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for world in args.worlds:
        local = min(args.local_world, world)
        baseline: dict[int, dict] = {}
        for mode, stage in MODES:
            if world == local and any(v == "local" for v in STAGE3.get(mode, {}).values()):
                continue  # hpZ and MiCS within one node are plain stage 3
            r = run("zcore", mode, stage, world, args)
            if "error" in r:
                print(f"| {world} | {mode} | failed: {r['error']} |")
                continue
            base = baseline.setdefault(stage, r)
            print(f"| {world} | {mode} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f}x | "
                  f"{r['sent_mb']:.1f} | {r['across_mb']:.1f} | {r['comm_s']:.3f} | "
                  f"{r['comm_s'] / base['comm_s']:.2f}x | {r['loss']:.4f} |", flush=True)
    if args.deepspeed:
        r = run("deepspeed", "qwZ+qgZ", 3, 2, args)
        outcome = r["error"] if "error" in r else f"step {r['step_s']:.3f} s"
        print(f"DeepSpeed 0.19.8, stage 3 with zero_quantized_weights and zero_quantized_gradients, 2 ranks: {outcome}")


if __name__ == "__main__":
    main()
