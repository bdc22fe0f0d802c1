"""What the per-step metrics cost (issue 18: under 1% of step time when on,
nothing when off): the same training with metrics off and on, alternating
in one process.

    .venv/bin/python bench/step_metrics_overhead.py [--stage 3] [--nvme-path DIR]
        [--steps 10] [--rounds 4] [--layers 6] [--d-model 512]

Two engines train two copies of zcore's demo GPT (vocab 8192, seq 256,
micro-batch 4, fp32, world 1): "off" with no monitor, "on" with the
csv_monitor and wall_clock_breakdown (every figure measured and written,
the split printed every step). The engines take turns step by step; each
round times --steps steps of each. The table gives the median step per
round and overall; the overhead is on / off - 1 over the medians.
The first optimizer step of "on" counts FLOPs and is never timed.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

import zcore
from zcore.demo.gpt import GPT, GPTConfig

VOCAB, SEQ, MICRO = 8192, 256, 4


def engine_for(args: argparse.Namespace, metrics: bool, runs: Path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=args.d_model, n_layers=args.layers,
                          n_heads=args.d_model // 64))
    zero: dict = {"stage": args.stage}
    if args.nvme_path:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_path}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "steps_per_print": 1,
    }
    if metrics:
        cfg["csv_monitor"] = {"enabled": True, "output_path": str(runs), "job_name": "overhead"}
        cfg["wall_clock_breakdown"] = True
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def step(engine, g: torch.Generator) -> float:
    ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    start = time.perf_counter()
    logits = engine(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    # An optimizer step behind the forward (NVMe) ends here: the other
    # engine's step must not run beside it.
    engine.optimizer.finish_step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=512)
    args = parser.parse_args()
    # The breakdown lines go to a handler of their own: not timed on a terminal.
    logging.getLogger("zcore.steps").addHandler(logging.NullHandler())
    logging.getLogger("zcore.steps").propagate = False
    with tempfile.TemporaryDirectory() as runs:
        engines = {"off": engine_for(args, False, Path(runs)), "on": engine_for(args, True, Path(runs))}
        g = torch.Generator().manual_seed(1)
        for engine in engines.values():
            step(engine, g)  # the first step: trace recording, FLOP counting
        times: dict[str, list[list[float]]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name in engines:
                times[name].append([])
            # Step by step in turn, so that the machine's drift falls on both alike.
            for _ in range(args.steps):
                for name, engine in engines.items():
                    times[name][-1].append(step(engine, g))
        rows = sum(1 for _ in (Path(runs) / "overhead").glob("*.csv"))
        for engine in engines.values():
            engine.destroy()
    print(f"stage {args.stage}, optimizer on {'NVMe' if args.nvme_path else 'the device'}, GPT {args.layers} "
          f"layers x d_model {args.d_model}, micro-batch {MICRO} x seq {SEQ}, fp32, world 1, "
          f"{torch.get_num_threads()} threads; {rows} metric files written")
    print("| round | off: median step s | on: median step s | on / off |")
    print("|---:|---:|---:|---:|")
    for r in range(args.rounds):
        off, on = statistics.median(times["off"][r]), statistics.median(times["on"][r])
        print(f"| {r + 1} | {off:.4f} | {on:.4f} | {on / off:.4f} |")
    off = statistics.median(t for round_ in times["off"] for t in round_)
    on = statistics.median(t for round_ in times["on"] for t in round_)
    print(f"| all | {off:.4f} | {on:.4f} | {on / off:.4f} |")
    print(f"overhead: {100 * (on / off - 1):+.2f}% of the step (target: under 1%)")


if __name__ == "__main__":
    main()
