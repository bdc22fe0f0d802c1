"""Runs a function on N local ranks (gloo on CPU) and collects what each returns.

Each rank is a new process with the environment torchrun would give it
(or none at all, for a world of one without a launcher). The parent never
waits forever: past the deadline, or when a rank dies, every rank is killed
and the test fails with the rank's traceback.

Ranks fork from a server that has imported torch and zcore (a fresh
interpreter spends about 1.3 s importing them, for every rank of every
test), and take the parent's environment as it is when they start.
``fresh_interpreter=True`` spawns them instead, for what a process reads
only when it starts (glibc's malloc tunables).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_FORKSERVER = mp.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["torch", "torch._dynamo", "zcore"])


def _rank_main(fn, rank, world_size, port, results, args, launcher, environment) -> None:
    os.environ.clear()
    os.environ.update(environment)
    if launcher:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    torch.set_num_threads(1)
    try:
        # Plain pickle: torch's multiprocessing reductions would pass tensors
        # as shared-memory handles that die with this process.
        results.put(("ok", rank, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # Deliver the result, then skip interpreter teardown, where torch
        # 2.13's gloo sometimes aborts (see zcore.demo.train.exit_now).
        results.close()
        results.join_thread()
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    launcher: bool = True,
    fresh_interpreter: bool = False,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank; returns the results by rank.

    ``launcher=False`` (world size 1 only) starts the rank with no torchrun
    environment, as a user running a plain script would.
    """
    assert launcher or world_size == 1
    ctx = mp.get_context("spawn") if fresh_interpreter else _FORKSERVER
    results = ctx.Queue()
    port = free_port()
    environment = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, results, args, launcher, environment),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} "
                                   f"did not finish within {timeout:.0f} s")
            try:
                status, rank, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and not p.is_alive()
                        and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
