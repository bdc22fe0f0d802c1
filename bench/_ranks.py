"""Local ranks for the benchmarks: ``run_local_ranks(fn, world, *args)``
spawns ``world`` processes with the environment torchrun gives (one torch
thread each, DeepSpeed on its CPU accelerator), runs ``fn(rank, world,
*args)`` in each and returns their results by rank. A rank that raises
gives ``{"error": "Type: first line"}`` instead, so that one failed system
leaves a line in the table rather than ending the run; a rank that dies or
outlives ``timeout`` ends it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Optional, Union

import torch

Failure = dict  # {"error": message}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world: int, local_world: int, port: int, args: tuple, out) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank % local_world), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
    except Exception as exc:  # noqa: BLE001 - reported in the table; the other runs go on
        traceback.print_exc()  # the whole story on stderr, the table gets a line
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    out.put(pickle.dumps((rank, result)))


def run_local_ranks(
    fn: Callable[..., Any], world: int, *args: Any, local_world: Optional[int] = None, timeout: float = 3600.0
) -> Union[list[Any], Failure]:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks, nodes of
    ``local_world`` ranks (default: one node); the results by rank, or the
    first rank's failure."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    local = world if local_world is None else local_world
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, local, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, result = pickle.loads(out.get(timeout=1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    return {"error": f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"}
                if time.monotonic() > deadline:
                    return {"error": f"no result within {timeout:.0f} s"}
                continue
            if isinstance(result, dict) and "error" in result:
                return result
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def interleaved_rounds(
    systems: list[str], repeats: int, run: Callable[[str], dict], describe: Callable[[dict], str]
) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """``run(system)`` for every system in turn, ``repeats`` rounds, so that
    drift in the machine hits every system alike; a system that fails once
    (its result holds "error") is not run again. Prints
    ``describe(result)`` after each run. Returns the results
    of the systems that ran, by system, and the failures."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    failed: dict[str, str] = {}
    for round_ in range(repeats):
        for system in systems:
            if system in failed:
                continue
            result = run(system)
            if "error" in result:
                failed[system] = result["error"]
                print(f"  round {round_ + 1} {system}: {result['error']}", flush=True)
                continue
            runs[system].append(result)
            print(f"  round {round_ + 1} {system}: {describe(result)}", flush=True)
    return {s: rs for s, rs in runs.items() if rs}, failed
