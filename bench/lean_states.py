"""What bf16 master weights and bf16 optimizer states cost in accuracy and
save in bytes (issue 38, part 4).

Every system trains the demo's byte-level GPT (zcore.demo: 4 layers,
d_model 192, 1.8M parameters) on the demo's corpus (zcore's own sources)
for the same 300 steps: bf16 compute, ZeRO-2 on 2 gloo ranks, AdamW with the
demo's warm-up and cosine schedule, clipping at 1.0, the same batches.
The peer is the same run with fp32 master weights and moments:

- fp32:        fp32 master weights and moments (zcore's default);
- bf16-master: bf16 master weights, fp32 moments, the optimizer on the host
               (zcore's CPU Adam; DeepSpeed's ZeRO-Offload choice);
- bf16-all:    bf16 master weights and moments, on the device tier and on the host.

Each system runs once per seed (the model's initialisation and the batches).
It prints the first seed's loss every 25 steps (mean over ranks), the mean
of the last 25 steps' losses against fp32's for each seed, and the
optimizer-state bytes per rank from memory_report() with the bytes per
trained element.

    cd bench && PYTHONPATH=../python ../.venv/bin/python lean_states.py
    cd bench && PYTHONPATH=../python ../.venv/bin/python lean_states.py --steps 20 --seeds 1   # does it run
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import zcore
from _ranks import run_local_ranks
from zcore.demo.gpt import GPT, lm_loss
from zcore.demo.train import MODEL, batches, corpus, training_config

WORLD = 2
MICRO_BATCH = 8
EVERY = 25
# name -> (optimizer tier, bf16 master weights, bf16 moments)
SYSTEMS = {
    "fp32 (device)": ("none", False, False),
    "bf16-master (host)": ("cpu", True, False),
    "bf16-all (device)": ("none", True, True),
    "bf16-all (host)": ("cpu", True, True),
}


def config(steps: int, tier: str, master: bool, moments: bool) -> dict:
    cfg = training_config(steps, MICRO_BATCH, None)
    cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": tier}}
    cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": master, "bf16_optimizer_states": moments}
    return cfg


def train(
    rank: int, world: int, data: torch.Tensor, seed: int, steps: int, tier: str, master: bool, moments: bool
) -> dict:
    torch.manual_seed(seed)
    engine, *_ = zcore.initialize(model=GPT(MODEL), config=config(steps, tier, master, moments))
    losses = []
    for _, (x, y) in zip(range(steps), batches(data, MICRO_BATCH, rank, world, seed=seed + 1)):
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    report = engine.memory_report()
    engine.destroy()
    return {
        "losses": losses,
        "state_bytes": report.measured.optimizer_states,
        "trained": report.trainable_parameters,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    data = corpus()  # read once: the sources may change while the systems run
    seeds = range(args.seeds)
    results = {}
    for name, (tier, master, moments) in SYSTEMS.items():
        for seed in seeds:
            results[name, seed] = run_local_ranks(
                train, WORLD, data, seed, args.steps, tier, master, moments, timeout=3600
            )[0]
        print(f"{name}: done", flush=True)
    names = list(SYSTEMS)
    print(f"\nThe demo GPT, {args.steps} steps, bf16, ZeRO-2 on {WORLD} gloo ranks; "
          f"seed 0's loss (mean over ranks) every {EVERY} steps")
    print(f"{'step':>6}" + "".join(f"{n:>22}" for n in names))
    for step in list(range(0, args.steps, EVERY)) + [args.steps - 1]:
        print(f"{step + 1:>6}" + "".join(f"{results[n, 0]['losses'][step]:>22.4f}" for n in names))
    tail = min(EVERY, args.steps)

    def last(name: str, seed: int) -> float:
        return sum(results[name, seed]["losses"][-tail:]) / tail

    print(f"\nmean loss of the last {tail} steps, and against fp32's of the same seed")
    print(f"{'system':<22}" + "".join(f"{'seed ' + str(s):>20}" for s in seeds)
          + f"{'mean vs fp32':>14}{'state MiB/rank':>16}{'B/element':>11}")
    for name in names:
        cells, ratios = "", []
        for seed in seeds:
            ratio = (last(name, seed) - last(names[0], seed)) / last(names[0], seed)
            ratios.append(ratio)
            cells += f"{last(name, seed):>11.4f} ({ratio:+.2%})"
        r = results[name, 0]
        per_element = r["state_bytes"] / (r["trained"] / WORLD)
        print(f"{name:<22}{cells}{sum(ratios) / len(ratios):>+14.2%}{r['state_bytes'] / 2**20:>16.3f}"
              f"{per_element:>11.2f}")


if __name__ == "__main__":
    main()
