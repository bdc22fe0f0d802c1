"""Trained by test_elastic_restart.py under torchrun's elastic agent.

Every start (attempt) resumes from the latest checkpoint in ``--ckpt`` (none
on the first), trains up to ``--steps`` global steps on the same global
batches at whatever world size torchrun gave it, and saves a checkpoint
after every ``--save-every``-th step. Rank 0 appends one line per event to
``--losses``:

    start attempt=A world=W from=G      (G: engine.global_steps after the load)
    step attempt=A world=W step=S loss=L (S: global_steps after the step; L: repr of the global mean loss)
    done attempt=A world=W

On the first attempt only (TORCHELASTIC_RESTART_COUNT=0), after step
``--kill-after S`` every rank waits in a barrier (so rank 0 has logged step
S), then the worker with local rank ``--kill-local-rank`` of the agent given
one sends itself SIGKILL (with ``--kill-agent``, its torchrun agent first:
the whole node is gone).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist

import zcore
from models import global_batch, loss_of, make_model
from training import rows, zcore_config
from zcore.demo.train import exit_now

BATCH = 12  # splits evenly over 1, 2, 3 and 4 ranks
MODEL = "gpt"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ckpt", required=True, help="checkpoint directory (saved to and resumed from)")
    parser.add_argument("--losses", required=True, help="file rank 0 appends the losses to")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=None, help="global step after which to SIGKILL")
    parser.add_argument("--kill-local-rank", type=int, default=-1, help="this agent's worker that dies (-1: none)")
    parser.add_argument("--kill-agent", action="store_true", help="also SIGKILL the torchrun agent (the node)")
    return parser.parse_args()


def log_line(path: str, line: str) -> None:
    # Opened and closed per line: what is written survives this process being killed.
    with open(path, "a") as f:
        f.write(line + "\n")


def kill_self(kill_agent: bool) -> None:
    if kill_agent:
        os.kill(os.getppid(), signal.SIGKILL)  # the worker's parent is its torchrun agent
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    args = parse_args()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.set_num_threads(1)
    engine, *_ = zcore.initialize(
        model=make_model(MODEL), config=zcore_config(args.stage, 1, 1.0, train_batch_size=BATCH)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    engine.load_checkpoint(args.ckpt)
    tag = f"attempt={attempt} world={world}"
    if rank == 0:
        log_line(args.losses, f"start {tag} from={engine.global_steps}")
    kill_after = args.kill_after if attempt == 0 else None
    while engine.global_steps < args.steps:
        step = engine.global_steps  # the global batch of this step, the same at any world size
        x, y = global_batch(MODEL, step, BATCH)
        part = rows(rank, world, BATCH)
        loss = loss_of(MODEL, engine(x[part]), y[part])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            log_line(args.losses, f"step {tag} step={engine.global_steps} loss={total.item() / world!r}")
        if engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.ckpt)
        if engine.global_steps == kill_after:
            dist.barrier()
            if int(os.environ["LOCAL_RANK"]) == args.kill_local_rank:
                kill_self(args.kill_agent)
    if rank == 0:
        log_line(args.losses, f"done {tag}")
    dist.barrier()
    dist.destroy_process_group()
    exit_now()  # skips the gloo static-teardown abort of torch 2.13 (see zcore.demo.train)


if __name__ == "__main__":
    main()
