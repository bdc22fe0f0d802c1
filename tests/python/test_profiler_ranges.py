"""zcore's work as named ranges in a torch.profiler trace (zcore.tracing):
a 2-rank stage-3 run with parameters and optimizer states on NVMe, under
``torch.profiler.profile``, shows its gathers, reduce-scatters, all-reduces,
NVMe reads and writes, optimizer steps and sub-group steps, and the waits,
in ``prof.events()`` and in the exported chrome trace, as often as such a
run does them; so does the optimizer step that runs behind the forward, on
its worker thread, when the profiler records every thread. Without a
profiler no range is made: each is one check."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

import zcore
from devices import skip_on_cuda_build_without_driver
from distributed import run_ranks
from models import global_batch, loss_of, make_model
from training import ON_DEMAND, zcore_config
from zcore import tracing
from zcore.tracing import Wait

STEPS = 2  # profiled, after one that records the trace
BATCH = 8  # 4 rows per rank
SUB_GROUP = 1000  # elements: each rank's ~14k-element shard spans several sub-groups


def train(engine, step: int, rank: int) -> None:
    x, y = global_batch("gpt", step, BATCH)
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    engine.backward(loss_of("gpt", engine(x[rows]), y[rows]))
    engine.step()


def traced_run(rank: int, world: int, tmp: str, params_on_nvme: bool, all_threads: bool) -> dict:
    """Range counts over STEPS profiled steps (after one that records the
    trace, unprofiled), from prof.events() and from the chrome trace; and
    how many ranges were made while no profiler ran."""
    nvme = {"device": "nvme", "nvme_path": f"{tmp}/nvme"}
    zero = {
        **ON_DEMAND,  # no group stays gathered between steps
        # Every shard on NVMe (each gather reads it first), or all in host
        # memory (the step then runs behind the next forward, on a worker thread).
        "offload_param": {**nvme, "max_in_cpu": 0} if params_on_nvme else {"device": "cpu"},
        "offload_optimizer": nvme,
        "sub_group_size": SUB_GROUP,
    }
    config = zcore_config(3, 1, 0.05, zero=zero, train_batch_size=BATCH)  # clipping: an all-reduce of the norm
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    made = Counter()
    record_function = tracing.record_function

    def counted(name: str):
        made[name] += 1
        return record_function(name)

    tracing.record_function = counted
    try:
        train(engine, 0, rank)
        engine.optimizer.finish_step()
        unprofiled = sum(made.values())
        experimental = _ExperimentalConfig(profile_all_threads=True) if all_threads else None
        with profile(activities=[ProfilerActivity.CPU], experimental_config=experimental) as prof:
            for step in range(1, 1 + STEPS):
                train(engine, step, rank)
            engine.optimizer.finish_step()  # the last step may run behind (zcore.step.background_step)
    finally:
        tracing.record_function = record_function
    trace = f"{tmp}/rank{rank}.json"
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        in_trace = Counter(e["name"] for e in json.load(f)["traceEvents"] if e.get("name", "").startswith("zcore::"))
    fetcher = engine.residency
    out = {
        "events": ranges(Counter(e.name for e in prof.events() if e.name.startswith("zcore::"))),
        "trace": ranges(in_trace),
        "unprofiled": unprofiled,
        "device": engine.context.device.type,
        "gathered groups": sum(not fetcher.persistent(g.index) for g in fetcher.groups),
        "units": len(engine.optimizer.units),
        "sub-groups": sum(s.numel > 0 for s in engine.optimizer.master.sub_groups),
    }
    engine.destroy()
    return out


def ranges(counts: Counter) -> dict[str, int]:
    return {name.removeprefix("zcore::"): n for name, n in counts.items()}


def run(tmp_path, params_on_nvme: bool, all_threads: bool) -> list[dict]:
    (tmp_path / "nvme").mkdir()
    results = run_ranks(traced_run, 2, str(tmp_path), params_on_nvme, all_threads, timeout=120)
    for r in results:
        assert r["unprofiled"] == 0  # no profiler, no range: one check each
        assert r["events"] == r["trace"]
    return results


def test_a_stage3_run_with_states_on_nvme_shows_each_range(tmp_path):
    for r in run(tmp_path, params_on_nvme=True, all_threads=False):
        got, groups, units, subs = r["events"], r["gathered groups"], r["units"], r["sub-groups"]
        assert got["all_gather"] >= STEPS * groups  # one per group per forward, at least
        assert got["reduce_scatter"] == STEPS * units  # one per unit per micro-step
        assert got["all_reduce"] == STEPS  # the gradient norm
        assert got["comm_wait"] >= got["all_gather"] + got["reduce_scatter"] + got["all_reduce"]
        assert got["optimizer_step"] == STEPS and got["optimizer_sub_group"] == STEPS * subs
        # Each step reads every parameter shard (for its gather) and every
        # sub-group of states, and writes both back; each read and write is waited for.
        assert got["nvme_read"] >= STEPS * (groups + subs) and got["nvme_write"] >= STEPS * (groups + subs)
        assert got["nvme_wait"] == got["nvme_read"] + got["nvme_write"]
        assert "step_wait" not in got  # parameters on NVMe: no step behind the forward
        assert ("copy_wait" in got) == (r["device"] == "cuda")  # host<->device copies


def test_the_step_behind_the_forward_shows_its_ranges_with_profile_all_threads(tmp_path):
    """Its sub-groups stream on a worker thread, which torch's profiler
    records only with profile_all_threads (by default, only the thread that
    started it: there, step_wait shows how long the forward waited)."""
    try:
        _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        pytest.skip(f"torch {torch.__version__}'s profiler has no profile_all_threads")
    for r in run(tmp_path, params_on_nvme=False, all_threads=True):
        got, subs = r["events"], r["sub-groups"]
        assert got["optimizer_step"] == STEPS and got["optimizer_sub_group"] == STEPS * subs
        assert got["nvme_read"] >= STEPS * subs and got["nvme_write"] >= STEPS * subs
        assert got["step_wait"] >= STEPS  # the next forward, or finish_step, waits for it
        assert got["all_gather"] >= STEPS * r["gathered groups"] and got["reduce_scatter"] == STEPS * r["units"]


@skip_on_cuda_build_without_driver
def test_without_a_profiler_a_range_is_a_no_op():
    assert isinstance(tracing.span("all_gather"), nullcontext)
    assert isinstance(tracing.waiting(Wait.COMM), nullcontext)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with tracing.span("all_gather"), tracing.waiting(Wait.NVME):
            pass
    assert {"zcore::all_gather", "zcore::nvme_wait"} <= {e.name for e in prof.events()}
