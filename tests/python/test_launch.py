"""``zcore.init_distributed`` (zcore.comm.launch), as a DeepSpeed script
calls ``deepspeed.init_distributed()`` before ``initialize``: it joins the
launcher's group, or the one its arguments describe, and an engine then
trains over it; misuse is refused by name."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zcore
from distributed import free_port, run_ranks
from zcore.errors import InvalidArgumentError, InvalidStateError


def join_then_train(rank: int, world: int, how: str, port: int) -> dict:
    if how == "launcher":
        zcore.init_distributed(dist_backend="gloo")
    else:  # a script that names its rank itself, over TCP, with no launcher's environment
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name)
        zcore.init_distributed(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    joined = (dist.get_backend(), dist.get_rank(), dist.get_world_size())
    zcore.init_distributed()  # the group exists: kept
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, *_ = zcore.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0, "zero_optimization": {"stage": 2}})
    x = torch.full((2, 4), float(rank + 1))
    engine.backward(engine(x).sum())
    engine.step()
    weight = engine.full_state_dict().get("weight")
    return {"joined": joined, "engine world": engine.world_size, "weight": weight}


@pytest.mark.parametrize("how", ["launcher", "arguments"])
def test_an_engine_trains_over_the_group_init_distributed_joined(how):
    results = run_ranks(join_then_train, 2, how, free_port(), timeout=120)
    assert [r["joined"] for r in results] == [("gloo", 0, 2), ("gloo", 1, 2)]
    assert [r["engine world"] for r in results] == [2, 2]
    # SGD on the mean of the ranks' gradients: sum over rows of x, averaged over ranks 1 and 2.
    torch.manual_seed(0)
    expected = torch.nn.Linear(4, 2).weight.detach() - 0.1 * torch.full((2, 4), (2 * 1.0 + 2 * 2.0) / 2)
    torch.testing.assert_close(results[0]["weight"], expected)


def misuse(rank: int, world: int) -> list[str]:
    seen = []

    def expect(error, pattern, call):
        with pytest.raises(error, match=pattern):
            call()
        seen.append(pattern)

    expect(InvalidArgumentError, "zcore runs on nccl or gloo", lambda: zcore.init_distributed(dist_backend="mpi"))
    expect(InvalidStateError, "dist_init_required=False", lambda: zcore.init_distributed(dist_init_required=False))
    expect(InvalidArgumentError, "give both, or neither", lambda: zcore.init_distributed(rank=0))
    if not torch.cuda.is_available():
        expect(InvalidArgumentError, "sees no GPU", lambda: zcore.init_distributed(dist_backend="nccl"))
    os.environ["OMPI_COMM_WORLD_RANK"] = "0"
    expect(InvalidStateError, "started by mpirun", zcore.init_distributed)
    del os.environ["OMPI_COMM_WORLD_RANK"]
    zcore.init_distributed(dist_backend="gloo")  # no launcher: a world of one
    assert (dist.get_world_size(), dist.get_backend()) == (1, "gloo")
    expect(InvalidStateError, "exists already, on gloo", lambda: zcore.init_distributed(dist_backend="nccl"))
    return seen


def test_misuse_is_refused_by_name():
    (seen,) = run_ranks(misuse, 1, launcher=False, timeout=120)
    assert len(seen) == (5 if torch.cuda.is_available() else 6)
