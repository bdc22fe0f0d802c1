"""PyTorch DCP checkpoints, both ways, against FSDP2 itself.

FSDP2 (``fully_shard``, gloo, CPU) trains and saves with ``dcp.save`` of
``get_state_dict``; zcore (stages 3 and 2, at 1, 2 and 3 ranks) loads it with
``zcore.checkpoint.load_dcp`` and goes on: its losses equal FSDP2's own
continuation. zcore trains and saves with ``save_dcp``; FSDP2 (at 1, 2 and 3
ranks) loads it with ``dcp.load`` + ``set_state_dict`` and goes on as
zcore's own continuation did. A zcore checkpoint has the entries FSDP2's
has; a checkpoint of another model or optimizer is refused by name; each
rank reads its own ranges only, within its shard and one tensor of memory.

Every step's batch is the same 6 samples whatever the world size (each rank
takes its equal share), so the global loss (the mean of the ranks') and the
update are the same computation on any number of ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict,
)

import zcore
from distributed import run_ranks
from zcore.checkpoint import load_dcp, save_dcp

from zcore.checkpoint.flat_chunks import flat_boxes

STEPS = 5
SAMPLES = 6  # per step, shared by the ranks
RELATIVE = 1e-6
LR, WEIGHT_DECAY = 1e-2, 0.01
TIMEOUT = 240


class Net(nn.Module):
    """Odd sizes, so that zcore's flat shards cut rows anywhere; a frozen
    layer and a buffer, which FSDP2 saves too."""

    def __init__(self, out: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 13)
        self.frozen = nn.Linear(13, 11)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(11, out)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(torch.tanh(self.frozen(h + self.shift.to(h.dtype))))


def net(seed: int, out: int = 5) -> Net:
    torch.manual_seed(seed)
    return Net(out)


def my_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 5, generator=g)
    share = SAMPLES // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def global_loss(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (5, 1, 3), (4, 6, 2, 3)])
def test_a_flat_range_is_the_boxes_of_its_elements(shape: tuple[int, ...]) -> None:
    numbered = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for start in range(numbered.numel() + 1):
        for stop in range(start, numbered.numel() + 1):
            elements = []
            for box in flat_boxes(shape, start, stop):
                part = numbered[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))].reshape(-1)
                assert part.tolist() == list(range(box.first, box.first + box.numel)), (start, stop, box)
                elements += part.tolist()
            assert elements == list(range(start, stop))
            assert len(flat_boxes(shape, start, stop)) <= 2 * len(shape) + 1  # a few boxes, never one per row


# FSDP2, as PyTorch's recipes run and checkpoint it.
def fsdp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = net(seed)
    for layer in (model.embed, model.frozen, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trained, lr=LR, weight_decay=WEIGHT_DECAY)


def fsdp_train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = my_batch(step, dist.get_rank(), dist.get_world_size())
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_loss(loss))
    return losses


def fsdp_save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(directory))


def fsdp_load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def fsdp_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# zcore.
def engine_of(stage: int, seed: int = 1, out: int = 5, adam_w_mode: bool = True, bf16: bool = False,
              **zero) -> zcore.Engine:
    world = dist.get_world_size()
    config = {
        "train_batch_size": SAMPLES,
        "train_micro_batch_size_per_gpu": SAMPLES // world,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "adam_w_mode": adam_w_mode}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
        "bf16": {"enabled": bf16},
    }
    engine, *_ = zcore.initialize(model=net(seed, out), config=config)
    return engine


def zcore_train(engine: zcore.Engine, steps: range) -> list[float]:
    losses = []
    dtype = next(engine.module.parameters()).dtype  # bf16's compute dtype
    for step in steps:
        x, y = my_batch(step, dist.get_rank(), dist.get_world_size())
        loss = F.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(global_loss(loss))
    return losses


AFTER = range(STEPS, 2 * STEPS)


def zcore_resumes(stage: int, directory: Path, **zero) -> list[float]:
    engine = engine_of(stage, **zero)
    load_dcp(engine, directory)
    losses = zcore_train(engine, AFTER)
    engine.destroy()
    return losses


def zcore_saves(stage: int, directory: Path, **zero) -> list[float]:
    """Trains from another start than FSDP2's run, saves, and returns its own continuation."""
    engine = engine_of(stage, seed=2, **zero)
    zcore_train(engine, range(STEPS))
    save_dcp(engine, directory)
    losses = zcore_train(engine, AFTER)
    engine.destroy()
    return losses


def fsdp_resumes(directory: Path) -> list[float]:
    model, optimizer = fsdp(seed=1)
    fsdp_load(model, optimizer, directory)
    return fsdp_train(model, optimizer, AFTER)


def nvme(root: Path, rank: int) -> dict:
    """Parameters and optimizer states on NVMe (a directory of files here)."""
    path = str(root / f"swap{rank}")
    return {"offload_optimizer": {"device": "nvme", "nvme_path": path},
            "offload_param": {"device": "nvme", "nvme_path": path}}


def two_ranks(rank: int, world: int, root: Path) -> dict:
    dist.init_process_group("gloo")  # FSDP2's and zcore's
    out: dict = {}
    # FSDP2 saves; zcore stage 3 and stage 2 (optimizer on the CPU) go on from it.
    model, optimizer = fsdp(seed=0)
    fsdp_train(model, optimizer, range(STEPS))
    fsdp_save(model, optimizer, root / "fsdp")
    out["saved_by_fsdp"] = fsdp_full_state(model)
    out["fsdp_continues"] = fsdp_train(model, optimizer, AFTER)
    del model, optimizer
    engine = engine_of(3)
    load_dcp(engine, root / "fsdp")
    out["zcore_loaded"] = engine.full_state_dict()
    out["z3_resumes"] = zcore_train(engine, AFTER)
    engine.destroy()
    out["z2_resumes"] = zcore_resumes(2, root / "fsdp", offload_optimizer={"device": "cpu"})
    # zcore stage 2 saves; FSDP2 goes on from it.
    out["zcore_continues"] = zcore_saves(2, root / "zcore")
    out["fsdp_resumes"] = fsdp_resumes(root / "zcore")
    return out


def three_ranks(rank: int, world: int, root: Path) -> dict:
    dist.init_process_group("gloo")
    return {
        "z3_resumes_fsdp2": zcore_resumes(3, root / "fsdp", **nvme(root / "resume", rank)),
        "fsdp_resumes_zcore2": fsdp_resumes(root / "zcore"),
        # zcore stage 3 with everything on NVMe saves; FSDP2 at one rank goes on from it.
        "zcore3_continues": zcore_saves(3, root / "zcore3", **nvme(root / "save", rank)),
    }


def one_rank(rank: int, world: int, root: Path) -> dict:
    dist.init_process_group("gloo")
    return {"z2_resumes_fsdp2": zcore_resumes(2, root / "fsdp"), "fsdp_resumes_zcore3": fsdp_resumes(root / "zcore3"),
            "bf16": bf16_saves_masters(root / "bf16"), "refusals": refusals(root),
            "weights only": weights_only(root / "fsdp")}


def weights_only(directory: Path) -> tuple[dict, int]:
    """(the weights, how many pieces have optimizer state) after a load of the weights only."""
    engine = engine_of(3)
    load_dcp(engine, directory, load_optimizer_states=False)
    out = engine.full_state_dict(), len(engine.optimizer.inner.state)
    engine.destroy()
    return out


def bf16_saves_masters(directory: Path) -> tuple[dict, dict]:
    """(the fp32 master weights, what DCP's own planner reads of the checkpoint) of a bf16 engine."""
    engine = engine_of(3, bf16=True)
    zcore_train(engine, range(1))
    save_dcp(engine, directory)
    masters = engine.full_state_dict()
    engine.destroy()
    read = {"model": {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in masters.items()}}
    dcp.load(read, checkpoint_id=str(directory))  # DefaultLoadPlanner: the whole tensors, cast
    return masters, read["model"]


def refusals(root: Path) -> dict[str, tuple[str, str]]:
    """(error class, message) of loads that must be refused."""
    out = {}
    for case, engine, directory in (
        ("another model", lambda: engine_of(3, out=4), root / "fsdp"),
        ("Adam, not AdamW", lambda: engine_of(2, adam_w_mode=False), root / "fsdp"),
        ("not a checkpoint", lambda: engine_of(2), root),
    ):
        e = engine()
        try:
            load_dcp(e, directory)
            out[case] = ("loaded", "")
        except zcore.ZcoreError as exc:
            out[case] = (type(exc).__name__, str(exc))
        e.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], list[dict], list[dict]]:
    root = tmp_path_factory.mktemp("dcp")
    two = run_ranks(two_ranks, 2, root, timeout=TIMEOUT)
    three = run_ranks(three_ranks, 3, root, timeout=TIMEOUT)
    one = run_ranks(one_rank, 1, root, timeout=TIMEOUT)
    return root, two, three, one


def same_losses(mine: list[float], theirs: list[float]) -> None:
    assert len(mine) == len(theirs) == STEPS
    assert mine == pytest.approx(theirs, rel=RELATIVE)


def test_zcore_resumes_fsdp2(runs) -> None:
    _, two, three, one = runs
    expected = two[0]["fsdp_continues"]
    for result in two:
        same_losses(result["z3_resumes"], expected)
        same_losses(result["z2_resumes"], expected)
    same_losses(three[0]["z3_resumes_fsdp2"], expected)
    same_losses(one[0]["z2_resumes_fsdp2"], expected)
    saved = two[0]["saved_by_fsdp"]
    weights_only, states = one[0]["weights only"]
    assert states == 0
    for loaded in (two[0]["zcore_loaded"], weights_only):
        assert loaded.keys() == saved.keys()
        for key in saved:
            assert torch.equal(loaded[key], saved[key]), key


def test_fsdp2_resumes_zcore(runs) -> None:
    _, two, three, one = runs
    assert two[0]["zcore_continues"] != pytest.approx(two[0]["fsdp_continues"], rel=1e-3)  # another run
    for result in two:
        same_losses(result["fsdp_resumes"], two[0]["zcore_continues"])
    same_losses(three[0]["fsdp_resumes_zcore2"], two[0]["zcore_continues"])
    same_losses(one[0]["fsdp_resumes_zcore3"], three[0]["zcore3_continues"])


@pytest.mark.parametrize("saved", ["zcore", "zcore3"])
def test_zcore_writes_the_entries_fsdp2_writes(runs, saved: str) -> None:
    root = runs[0]
    fsdp_md = dcp.FileSystemReader(str(root / "fsdp")).read_metadata()
    zcore_md = dcp.FileSystemReader(str(root / saved)).read_metadata()
    assert zcore_md.state_dict_metadata.keys() == fsdp_md.state_dict_metadata.keys()
    assert zcore_md.planner_data == fsdp_md.planner_data
    for key, theirs in fsdp_md.state_dict_metadata.items():
        mine = zcore_md.state_dict_metadata[key]
        assert type(mine) is type(theirs), key
        if hasattr(theirs, "size"):
            assert (mine.size, mine.properties.dtype) == (theirs.size, theirs.properties.dtype), key


def test_bf16_engine_saves_its_fp32_masters(runs) -> None:
    masters, read = runs[3][0]["bf16"]
    assert masters.keys() == read.keys()
    for key, value in masters.items():
        assert value.dtype == torch.float32
        assert torch.equal(read[key], value.double()), key


def test_another_model_or_optimizer_is_refused_by_name(runs) -> None:
    refused = runs[3][0]["refusals"]
    kind, message = refused["another model"]
    assert kind == "CheckpointMismatchError"
    assert "head.weight: checkpoint [5, 11], model [4, 11]" in message and "head.bias" in message
    kind, message = refused["Adam, not AdamW"]
    assert kind == "CheckpointMismatchError"
    assert "decoupled_weight_decay=True" in message
    kind, message = refused["not a checkpoint"]
    assert kind == "CheckpointError" and "no .metadata file" in message


# Memory and reads: 8 layers of 1024 x 1024, so that one tensor (4 MiB) is a
# small part of a rank's shard (weights and Adam's two moments, ~50 MB of
# ~100 MB). Peak memory is the growth of the process's resident peak (VmHWM,
# reset through /proc/self/clear_refs) across the call; bytes read, the
# growth of /proc/self/io's rchar. The ranks run with a fixed
# MALLOC_MMAP_THRESHOLD_, so that glibc returns freed blocks of a few MiB
# instead of keeping them in its heap for the next call to reuse.
WIDE, LAYERS = 1024, 8
TENSOR_BYTES = WIDE * WIDE * 4
WHOLE_BYTES = 3 * LAYERS * (WIDE * WIDE + WIDE) * 4  # fp32 weights, exp_avg, exp_avg_sq


def wide(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh()) for _ in range(LAYERS)))


def _proc(file: str, field: str) -> int:
    with open(f"/proc/self/{file}") as f:
        value = next(int(line.split()[1]) for line in f if line.startswith(field))
    return value * 1024 if file == "status" else value


def growth(call) -> tuple[int, int]:
    """(peak resident memory, bytes read) that ``call`` added."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from the current resident size
    resident, read = _proc("status", "VmRSS:"), _proc("io", "rchar:")
    call()
    return _proc("status", "VmHWM:") - resident, _proc("io", "rchar:") - read


def wide_ranks(rank: int, world: int, root: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    x = torch.randn(2, WIDE)
    model = wide(0)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    model(x).square().mean().backward()
    optimizer.step()
    fsdp_save(model, optimizer, root / "wide_fsdp")
    del model, optimizer
    config = {"train_batch_size": 2 * world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zcore.initialize(model=wide(1), config=config)
    engine.backward(engine(x).square().mean())
    engine.step()
    # The first save grows the process once (gloo's buffers, the allocator's
    # heap), so the bounds apply from the second.
    save_dcp(engine, root / "wide_zcore")
    out = {"save": growth(lambda: save_dcp(engine, root / "wide_zcore")),
           "load own": growth(lambda: load_dcp(engine, root / "wide_zcore")),
           "load fsdp2": growth(lambda: load_dcp(engine, root / "wide_fsdp"))}
    engine.destroy()
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_each_rank_reads_its_own_ranges_within_its_shard_and_one_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    world = 2
    shard = WHOLE_BYTES // world
    slack = 8 << 20
    for rank, result in enumerate(run_ranks(wide_ranks, world, tmp_path, timeout=TIMEOUT, fresh_interpreter=True)):
        print(rank, {k: (m >> 20, r >> 20) for k, (m, r) in result.items()})
        for case in ("load own", "load fsdp2"):
            memory, _ = result[case]
            # Staged: this rank's ranges (half the checkpoint); read: one saved chunk at a time.
            assert memory < shard + TENSOR_BYTES + slack, (rank, case, memory)
            # This rank's ranges, and no more than a part of a row beside
            # (the metadata, each saved chunk's record); the whole would be twice.
            _, read = result[case]
            assert shard * 0.99 < read < shard + TENSOR_BYTES, (rank, case, read)
        memory, _ = result["save"]
        assert memory < shard + TENSOR_BYTES + slack, (rank, memory)
