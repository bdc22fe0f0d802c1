"""The engine on ZCORE_TEST_DEVICE (NCCL on a GPU) at world 1, for what the
tests parametrized over the device switch do not cover already (training
at every stage and precision, offload to the host and NVMe, generation,
GatheredParameters, Hugging Face directories, MetaInit: see the tests
marked ``device``):

- checkpoints saved on the device load into an engine on the CPU, and the
  reverse: every weight and optimizer state bit for bit, then the same
  losses as the run that was not interrupted (1e-6 relative on one device;
  1e-5 across devices, whose matmuls round differently); and
  ``zcore.checkpoint.consolidate`` gives the saved weights;
- the memory report and the step metrics against the device's allocator
  (on CUDA, ``torch.cuda.memory_allocated`` deltas around initialize, the
  first optimizer step and a forward) and against the layout's theory (as
  test_memory_report, on either device); copy waits where NVMe shards pass
  through host memory to a GPU;
- a process group the user makes beside zcore's, used between steps, and
  forwards on a side stream (on the CPU, which has no streams, the rest of
  the test runs as it is), against torch's AdamW on the device.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import devices
import zcore
from distributed import run_ranks
from models import global_batch, loss_of, make_model, wide_mlp
from training import GLOBAL_BATCH, ON_DEMAND, assert_matches, train_reference, zcore_config

pytestmark = pytest.mark.device
TIMEOUT = 300


def train_steps(engine, steps: range) -> list[float]:
    """The tiny GPT on the global batches of ``steps``, on the engine's device."""
    device = engine.context.device
    losses = []
    for step in steps:
        x, y = global_batch("gpt", step, GLOBAL_BATCH)
        loss = loss_of("gpt", engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# Checkpoints across devices.
SAVE_AT, STEPS = 3, 6
# Stage 3, clipping (a norm over the device's shards); fp32 master and Adam
# states on the compute device.
CHECKPOINT_CONFIG = zcore_config(3, 1, 1.0, zero=ON_DEMAND)


def checkpoint_state(engine) -> dict:
    """What a checkpoint restores, on the CPU: the fp32 weights, every Adam
    state of every piece, the counters."""
    pieces = [p for g in engine.optimizer.param_groups for p in g["params"]]
    on_cpu = [{k: torch.as_tensor(v).cpu().clone() for k, v in engine.optimizer.state[p].items()} for p in pieces]
    counters = (engine.global_steps, engine.global_samples, engine.micro_steps)
    return {"weights": engine.full_state_dict(), "adam": on_cpu, "counters": counters}


def load_then_save(rank: int, world: int, device: str, load_from, save_to) -> dict:
    """On ``device``: given ``load_from``, a new engine loads it and trains
    on to STEPS; given ``save_to``, another trains SAVE_AT steps, saves
    there and trains on to STEPS, uninterrupted."""
    devices.init_process_group(device)
    out = {}
    if load_from is not None:
        engine, *_ = zcore.initialize(model=make_model("gpt"), config=CHECKPOINT_CONFIG)
        devices.assert_on(engine, device)
        engine.load_checkpoint(load_from)
        out["loaded"] = checkpoint_state(engine)
        out["resumed"] = train_steps(engine, range(SAVE_AT, STEPS))
        engine.destroy()
    if save_to is not None:
        engine, *_ = zcore.initialize(model=make_model("gpt"), config=CHECKPOINT_CONFIG)
        devices.assert_on(engine, device)
        losses = train_steps(engine, range(SAVE_AT))
        engine.save_checkpoint(save_to)
        out["saved"] = checkpoint_state(engine)
        out["uninterrupted"] = losses + train_steps(engine, range(SAVE_AT, STEPS))
        engine.destroy()
    return out


def assert_same_state(got: dict, expected: dict, label: str) -> None:
    assert got["counters"] == expected["counters"], label
    assert got["weights"].keys() == expected["weights"].keys(), label
    for key, value in expected["weights"].items():
        assert torch.equal(got["weights"][key], value), f"{label}: {key}"
    assert len(got["adam"]) == len(expected["adam"]) > 0, label
    for k, (a, b) in enumerate(zip(got["adam"], expected["adam"])):
        assert a.keys() == b.keys(), label
        for name in a:
            assert torch.equal(a[name], b[name]), f"{label}: piece {k} {name}"


def assert_same_losses(got: list[float], expected: list[float], relative: float, label: str) -> None:
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= relative * abs(b), f"{label}: step {SAVE_AT + step} loss {a!r} vs {b!r}"


def test_checkpoints_move_between_the_device_and_the_cpu(device: str, tmp_path: Path) -> None:
    on_device, on_cpu = str(tmp_path / "from-device"), str(tmp_path / "from-cpu")
    first = run_ranks(load_then_save, 1, device, None, on_device, launcher=False, timeout=TIMEOUT)[0]
    cpu = run_ranks(load_then_save, 1, "cpu", on_device, on_cpu, launcher=False, timeout=TIMEOUT)[0]
    back = run_ranks(load_then_save, 1, device, on_cpu, None, launcher=False, timeout=TIMEOUT)[0]
    relative = 1e-6 if device == "cpu" else 1e-5
    assert_same_state(cpu["loaded"], first["saved"], f"saved on {device}, loaded on cpu")
    assert_same_losses(cpu["resumed"], first["uninterrupted"][SAVE_AT:], relative, f"{device} -> cpu")
    assert_same_state(back["loaded"], cpu["saved"], f"saved on cpu, loaded on {device}")
    assert_same_losses(back["resumed"], cpu["uninterrupted"][SAVE_AT:], relative, f"cpu -> {device}")
    # Consolidation reads what the device wrote: its weights, exactly.
    consolidated = load_file(zcore.checkpoint.consolidate(on_device, tmp_path / "out", progress=False)[0])
    assert consolidated.keys() == first["saved"]["weights"].keys()
    for key, value in first["saved"]["weights"].items():
        assert torch.equal(consolidated[key], value), key


# Memory: the report and the step metrics against the allocator and the theory.
ROWS = 32  # every activation of the wide MLP is then a whole number of 512-byte blocks
INPUT_BYTES = ROWS * 200 * 4
OUTPUT_BYTES = ROWS * 10 * 4
# Saved for backward: the input (the first Linear's weight gradient) and
# both ReLU outputs (which the next Linear saves too).
ACTIVATIONS = ROWS * (200 + 300 + 300) * 4
# Bytes the allocator may hold beyond what the report counts: each
# allocation rounded up to 512 bytes (tens of tensors here), and small
# tensors zcore keeps that no category counts. A category missed whole is
# 4 x 153k bytes or more.
SLACK = 64 * 1024
THEORY = 0.02  # relative, as test_memory_report (padding to the world size)


def allocated(device: torch.device):
    """The CUDA allocator's count; None on the CPU (no allocator to ask)."""
    if device.type != "cuda":
        return None
    gc.collect()  # temporaries caught in reference cycles
    return devices.memory_allocated(device)


def device_bytes(report) -> int:
    return report.measured_tiers["device"].total


def memory_on_device(rank: int, world: int, device: str, stage: int, runs: str) -> dict:
    on = devices.init_process_group(device)
    config = zcore_config(
        stage, 1, 0.0, zero=ON_DEMAND if stage == 3 else None, train_batch_size=ROWS,
        csv_monitor={"enabled": True, "output_path": runs, "job_name": f"stage{stage}"},
    )
    model = wide_mlp()
    before_init = allocated(on)
    engine, *_ = zcore.initialize(model=model, config=config)
    devices.assert_on(engine, device)
    out = {"init": (before_init, allocated(on), engine.memory_report())}

    def batch(step: int) -> torch.Tensor:
        return torch.randn(ROWS, 200, generator=torch.Generator().manual_seed(step)).to(on)

    engine.backward(engine(batch(0)).pow(2).mean())
    first_step = (allocated(on), engine.memory_report())
    engine.step()
    out["first step"] = (*first_step, allocated(on), engine.memory_report())
    for step in (1, 2):  # after the step whose FLOPs the metrics count
        x = batch(step)
        start = allocated(on)
        y = engine(x)
        out["forward"] = None if start is None else allocated(on) - start
        engine.backward(y.pow(2).mean())
        engine.step()
        del y
    out["metrics"] = engine.last_step_metrics.memory
    out["report"] = engine.memory_report()
    out["arena"] = engine.gather_stats().arena_capacity if stage == 3 else 0
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_memory_report_and_metrics_match_the_allocator_and_the_theory(device: str, stage: int, tmp_path: Path) -> None:
    got = run_ranks(memory_on_device, 1, device, stage, str(tmp_path), launcher=False, timeout=TIMEOUT)[0]
    report = got["report"]
    # The step metrics' memory is the report's, with the activations by hand.
    for tier, figures in report.measured_tiers.items():
        for category in ("parameters", "gradients", "optimizer_states", "buffers"):
            assert got["metrics"][tier][category] == getattr(figures, category), (tier, category)
    assert got["metrics"]["device"]["activations"] == ACTIVATIONS
    # Everything on the device at world 1, each category as the theory says.
    params = sum(p.numel() for p in wide_mlp().parameters())
    assert report.measured.optimizer_states == 12 * params and report.measured.parameters == 4 * params
    for tier in ("device", "host", "nvme"):
        measured, theory = report.measured_tiers[tier], report.theoretical_tiers[tier]
        for category in ("parameters", "gradients", "optimizer_states", "buffers"):
            m, t = getattr(measured, category), getattr(theory, category)
            assert abs(m - t) <= THEORY * t, f"{category} on {tier}: measured {m}, theory {t}\n{report}"
    if device != "cuda":
        return
    # The allocator holds what the report counts on the device, plus the
    # gather arena (stage 3), which the report leaves out as working memory.
    before, after, at_init = got["init"]
    extra = (after - before) - device_bytes(at_init) - got["arena"]
    assert abs(extra) <= SLACK, f"initialize allocated {after - before} bytes, arena {got['arena']}, report:\n{at_init}"
    # The first step allocates Adam's two states per piece, as counted.
    before, at_start, after, at_end = got["first step"]
    extra = (after - before) - (device_bytes(at_end) - device_bytes(at_start))
    assert abs(extra) <= SLACK, f"the first step allocated {after - before} bytes, report:\n{at_start}\n->\n{at_end}"
    if stage < 3:  # stage 3 may keep gathered groups outside its arena after a forward
        # A forward leaves its saved activations (less its input, allocated
        # before it) and its output (one 512-byte multiple) allocated.
        expected = ACTIVATIONS - INPUT_BYTES + -(-OUTPUT_BYTES // 512) * 512
        assert got["forward"] == expected, f"a forward left {got['forward']} bytes allocated, expected {expected}"


def copy_waits(rank: int, world: int, device: str, nvme: str, runs: str) -> dict:
    devices.init_process_group(device)
    offload = {"device": "nvme", "nvme_path": nvme}
    zero = {**ON_DEMAND, "offload_param": {**offload, "max_in_cpu": 0}, "offload_optimizer": offload}
    csv = {"enabled": True, "output_path": runs, "job_name": "job"}
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=zcore_config(3, 1, 0.0, zero=zero, csv_monitor=csv))
    devices.assert_on(engine, device)
    train_steps(engine, range(3))
    record = engine.last_step_metrics
    engine.destroy()
    return {"time": record.time_ms, "memory": record.memory}


def test_step_metrics_count_copies_between_the_host_and_the_device(device: str, tmp_path: Path) -> None:
    """Parameter shards and optimizer states on NVMe: on a GPU each shard
    read is copied from host memory to the device (copy waits); on the
    CPU the host is the device, and nothing is copied."""
    (tmp_path / "nvme").mkdir()
    got = run_ranks(copy_waits, 1, device, str(tmp_path / "nvme"), str(tmp_path / "runs"),
                    launcher=False, timeout=TIMEOUT)[0]
    time, memory = got["time"], got["memory"]
    parts = ("forward", "backward", "step", "comm_wait", "nvme_wait", "copy_wait", "other")
    assert sum(time[p] for p in parts) == pytest.approx(time["total"], rel=1e-6)
    assert time["nvme_wait"] > 0
    assert (time["copy_wait"] > 0) == (device == "cuda"), time
    assert memory["nvme"]["parameters"] > 0 and memory["nvme"]["optimizer_states"] > 0
    assert memory["device"]["parameters"] == 0  # nothing stays gathered, every shard on NVMe
    assert memory["device"]["activations"] > 0


# A user's process group and forwards on a side stream.
SIDE_STEPS = 6
# Stage 3, each group gathered and released around its module (on the side
# stream), with shards in host memory, copied ahead on zcore's copy stream.
SIDE_CONFIG = zcore_config(3, 1, 0.0, zero={**ON_DEMAND, "offload_param": {"device": "cpu"}})


def user_group_and_side_stream(rank: int, world: int, device: str) -> dict:
    on = devices.init_process_group(device)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=SIDE_CONFIG)
    devices.assert_on(engine, device)
    group = dist.new_group([0])  # the user's, beside zcore's default group
    losses, reduced = [], []
    for step in range(SIDE_STEPS):
        x, y = global_batch("gpt", step, GLOBAL_BATCH)
        with devices.side_stream(on):
            loss = loss_of("gpt", engine(x.to(on)), y.to(on))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)  # the user's collective between zcore's
        losses.append(loss.item())
        reduced.append(total.item())
    with zcore.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
    stats = engine.gather_stats()
    engine.destroy()
    return {"losses": losses, "reduced": reduced, "params": params, "backend": dist.get_backend(group),
            "fetched_ahead": stats.shard_fetches_ahead, "staged": stats.staged_bytes}


def test_a_users_process_group_and_forwards_on_a_side_stream(device: str) -> None:
    got = run_ranks(user_group_and_side_stream, 1, device, launcher=False, timeout=TIMEOUT)[0]
    assert got["backend"] == devices.BACKENDS[device]
    assert got["reduced"] == got["losses"]  # a sum over the group of one
    assert got["fetched_ahead"] > 0 and got["staged"] == 0
    ref = train_reference("gpt", 0.0, SIDE_STEPS, 1, 1, device=device)
    assert_matches(got, ref, 1e-5, f"side stream on {device}")


# ZeRO-Offload's host buffers beside the master: page-locked as the master is.
def offload_buffers(rank: int, world: int, device: str, pin: bool) -> dict:
    devices.init_process_group(device)
    config = zcore_config(2, 1, 1.0, "bf16", zero={"offload_optimizer": {"device": "cpu", "pin_memory": pin}})
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    devices.assert_on(engine, device)
    losses = train_steps(engine, range(3))
    update = engine.optimizer.update
    staged = [s for s, in_place in zip(update.staging, update.in_place) if not in_place]
    pinned = {
        "master": [s.is_pinned() for s in engine.optimizer.master.shards],
        "host_grads": [g.is_pinned() for g in update.host_grads or []],
        "staging": [s.is_pinned() for s in staged],
    }
    engine.destroy()
    return {"losses": losses, "pinned": pinned}


def test_offloaded_optimizer_buffers_are_page_locked_as_the_master_is(device: str) -> None:
    """With pin_memory, on a GPU, the gradients copied to the host and the
    bf16 shards copied back go through page-locked buffers, as the master
    does (pageable, they ran at a third of the bandwidth on an H200); the
    losses are the same bits either way. On the CPU nothing is copied and
    nothing can be pinned."""
    pinned, pageable = (
        run_ranks(offload_buffers, 1, device, pin, launcher=False, timeout=TIMEOUT)[0] for pin in (True, False)
    )
    assert pinned["losses"] == pageable["losses"]
    for kind in ("master", "host_grads", "staging"):
        assert not any(pageable["pinned"][kind]), kind
        if device == "cuda":
            assert pinned["pinned"][kind] and all(pinned["pinned"][kind]), kind
        else:
            assert not any(pinned["pinned"][kind]), kind
