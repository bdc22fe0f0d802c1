"""zcore.comm.topology: which ranks share a node, from LOCAL_WORLD_SIZE or from
the user's DeviceMesh, and the process groups built from it (checked by
all-reducing each rank's number over each group: the sum names the members)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zcore
from distributed import run_ranks
from models import make_model
from zcore.errors import ConfigError
from zcore.comm.topology import build_topology


def members(group) -> int:
    """The sum of the global ranks in ``group`` (a RankGroup)."""
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=group.group)
    return int(x.item())


def groups_of(rank: int, world: int, mesh_rows) -> dict:
    dist.init_process_group("gloo")
    mesh = None
    if mesh_rows is not None:
        mesh = DeviceMesh("cpu", torch.tensor(mesh_rows), mesh_dim_names=("node", "local"))
    else:
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    t = build_topology(mesh, "cpu")
    return {
        "shape": (t.nodes, t.local_size),
        "in rank order": t.in_rank_order,
        "node": members(t.node_local()),
        "across": members(t.across_nodes()),
        "blocks of 4": members(t.blocks(4)),
        "strided 2": members(t.strided(2)),
        "rank in node": t.node_local().rank,
    }


def test_nodes_from_local_world_size():
    got = run_ranks(groups_of, 4, None, timeout=60)
    # Nodes {0, 1} and {2, 3}; across nodes {0, 2} and {1, 3}.
    assert [g["node"] for g in got] == [1, 1, 5, 5]
    assert [g["across"] for g in got] == [2, 4, 2, 4]
    assert [g["blocks of 4"] for g in got] == [6] * 4
    assert [g["strided 2"] for g in got] == [2, 4, 2, 4]
    assert [g["rank in node"] for g in got] == [0, 1, 0, 1]
    assert all(g["shape"] == (2, 2) and g["in rank order"] for g in got)


def test_nodes_from_a_mesh_in_another_order():
    got = run_ranks(groups_of, 4, [[0, 2], [1, 3]], timeout=60)
    # Nodes {0, 2} and {1, 3}; blocks hold their ranks in torch's (sorted) order.
    assert [g["node"] for g in got] == [2, 4, 2, 4]
    assert [g["rank in node"] for g in got] == [0, 0, 1, 1]
    # Position 0 of {0, 2} and of {1, 3} (ranks 0 and 1) hold the same shard, as do ranks 2 and 3.
    assert [g["strided 2"] for g in got] == [1, 1, 5, 5]
    assert not any(g["in rank order"] for g in got)


def refused(rank: int, world: int, case: str) -> str:
    dist.init_process_group("gloo")
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW"},
              "zero_optimization": {"stage": 3, "mics_shard_size": 2}}
    mesh = None
    if case == "LOCAL_WORLD_SIZE 3":
        os.environ["LOCAL_WORLD_SIZE"] = "3"
    elif case == "3-D mesh":
        mesh = init_device_mesh("cpu", (1, 2, 2))
    try:
        zcore.initialize(model=make_model("gpt"), config=config, device_mesh=mesh)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize(
    "case, named",
    [
        ("LOCAL_WORLD_SIZE 3", "LOCAL_WORLD_SIZE = '3' must be a positive divisor"),
        ("3-D mesh", "device_mesh has 3 dimensions"),
    ],
)
def test_a_layout_that_cannot_be_nodes_is_refused(case, named):
    for message in run_ranks(refused, 4, case, timeout=60):
        assert named in message
