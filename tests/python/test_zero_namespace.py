"""zcore.zero, DeepSpeed's deepspeed.zero names: Init builds a model that is
never whole on a rank; GatheredParameters(..., modifier_rank=0) lets rank 0
change weights that every rank then trains from; register_external_parameter
(in a module's __init__, and through GatheredParameters' fwd_module) as
DeepSpeed documents it, and unregister_external_parameter;
unwrap_model_for_generation gathers the model once for a block of
forwards, and training goes on after it. One spawn of two
ranks runs the distributed checks; the arguments' checks run here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zcore
from distributed import run_ranks
from log_capture import capture_zcore_log

TIMEOUT = 240
LR, WEIGHT_DECAY = 1e-2, 0.01
ROWS = 4  # per rank


def config(stage: int = 3) -> dict:
    return {
        "train_batch_size": 2 * ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "eps": 1e-4}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class ExternalNet(nn.Module):
    """DeepSpeed's documented use: layer1's weight is used again by the parent."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(6, 6, bias=False)
        self.layer2 = nn.Linear(6, 3)
        zcore.zero.register_external_parameter(self, self.layer1.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layer1(x))
        return self.layer2(h @ self.layer1.weight)


class FwdModuleNet(ExternalNet):
    """The same use, declared where it happens (GatheredParameters' fwd_module)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.layer1 = nn.Linear(6, 6, bias=False)
        self.layer2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layer1(x))
        with zcore.zero.GatheredParameters(self.layer1.weight, fwd_module=self):
            return self.layer2(h @ self.layer1.weight)


class Block(FwdModuleNet):
    """fwd_module a module that holds no parameter of its own: zcore hooks it
    during its first forward."""


class BlockFwdModuleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def data(step: int, world: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(world * ROWS, 6, generator=g), torch.randint(0, 3, (world * ROWS,), generator=g)


def train(engine, rank: int, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = data(step)
        loss = nn.functional.cross_entropy(engine(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / 2)
    return losses


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    with zcore.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def built_under_init(rank: int, world: int) -> dict:
    with zcore.zero.Init(config_dict_or_path=config()):
        model = Net()
    on_meta = all(p.is_meta for p in model.parameters())
    engine, *_ = zcore.initialize(model=model, config=config())
    # Between uses a rank holds its shards only: the parameters are empty placeholders.
    held = sum(p.data.numel() for p in model.parameters())  # numel() counts a sharded parameter whole
    built = values(model)
    with zcore.zero.GatheredParameters(model.fc1.weight, modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                model.fc1.weight.copy_(torch.arange(48.0).reshape(8, 6) / 100)
            else:
                model.fc1.weight.fill_(-1.0)  # another rank's change is not kept
    modified = values(model)
    losses = train(engine, rank, 2)
    trained = values(model)
    engine.destroy()
    return {"on_meta": on_meta, "held": held, "built": built, "modified": modified, "losses": losses, "trained": trained}


def external_uses(rank: int, world: int) -> dict:
    out = {}
    for cls in (ExternalNet, FwdModuleNet, BlockFwdModuleNet):
        torch.manual_seed(0)
        model = cls()
        engine, *_ = zcore.initialize(model=model, config=config())
        out[cls.__name__] = {"losses": train(engine, rank, 3), "params": values(model)}
        engine.destroy()
    # Declared, then withdrawn before initialize: the first forward finds the
    # undeclared use, and declares it then.
    messages = capture_zcore_log()
    torch.manual_seed(0)
    model = ExternalNet()
    zcore.zero.unregister_external_parameter(model, model.layer1.weight)
    engine, *_ = zcore.initialize(model=model, config=config())
    out["withdrawn"] = {"losses": train(engine, rank, 3), "params": values(model),
                        "declared": [m for m in messages.messages if "neither owns nor declared" in m]}
    engine.destroy()
    return out


def unwrapped_for_generation(rank: int, world: int) -> dict:
    """A step, forwards in unwrap_model_for_generation's block, another step."""
    torch.manual_seed(0)
    model = Net()
    engine, *_ = zcore.initialize(model=model, config=config())
    losses = train(engine, rank, 1)
    x = data(100)[0]
    with zcore.zero.unwrap_model_for_generation(engine) as unwrapped:
        before = engine.gather_stats().gathers
        with torch.no_grad():
            outputs = [unwrapped(x) for _ in range(3)]
        gathers = engine.gather_stats().gathers - before
        params = {n: p.detach().clone() for n, p in unwrapped.named_parameters()}
    held = sum(p.data.numel() for p in model.parameters())  # released again after the block
    losses += train(engine, rank, 1)[:1]
    engine.destroy()
    return {"outputs": outputs, "gathers": gathers, "params": params, "held": held, "losses": losses,
            "is_module": unwrapped is model}


class LegacyScale(nn.Module):
    """A parameter made by a legacy constructor, which ignores Init's meta
    device, and given its values in __init__ (DeepSpeed's test_zero_context)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.scale = nn.Parameter(torch.Tensor(3).fill_(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


def legacy_parameter_under_init(rank: int, world: int) -> dict:
    with zcore.zero.Init(config_dict_or_path=config()):
        model = LegacyScale()
    on_meta = {n: p.is_meta for n, p in model.named_parameters()}
    engine, *_ = zcore.initialize(model=model, config=config())
    built = values(model)
    losses = train(engine, rank, 2)
    engine.destroy()
    return {"on_meta": on_meta, "built": built, "losses": losses}


def two_engines(rank: int, world: int) -> dict:
    """One GatheredParameters block over the parameters of two engines
    (DeepSpeed's checkpoint tests compare two models so): both gathered;
    with modifier_rank, both written."""
    models = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        models.append(Net())
    engines = [zcore.initialize(model=m, config=config())[0] for m in models]
    params = [p for m in models for p in m.parameters()]
    with zcore.zero.GatheredParameters(params):
        seen = [p.detach().clone() for p in params]
    with zcore.zero.GatheredParameters(params, modifier_rank=0):
        with torch.no_grad():
            for p in params:
                p.fill_(float(rank + 1))  # rank 0's ones are kept
    written = [values(m) for m in models]
    for engine in engines:
        engine.destroy()
    return {"seen": seen, "written": written}


def distributed_checks(rank: int, world: int) -> dict:
    return {"init": built_under_init(rank, world), "external": external_uses(rank, world),
            "unwrap": unwrapped_for_generation(rank, world), "legacy": legacy_parameter_under_init(rank, world),
            "two engines": two_engines(rank, world)}


def reference_net() -> Net:
    """zcore.MetaInit's contract: each module's reset_parameters() under its own seed."""
    model = Net()
    for name, module in model.named_modules():
        if list(module.parameters(recurse=False)):
            torch.manual_seed(zcore.MetaInit().module_seed(name))
            module.reset_parameters()
    return model


def train_reference(model: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-4)
    losses = []
    for step in range(steps):
        x, y = data(step)
        halves = [nn.functional.cross_entropy(model(x[r * ROWS:(r + 1) * ROWS]), y[r * ROWS:(r + 1) * ROWS]) for r in range(2)]
        (sum(halves) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the config's default gradient_clipping
        opt.step()
        opt.zero_grad()
        losses.append(sum(h.item() for h in halves) / 2)
    return losses


def assert_close(got: dict, model: nn.Module, what: str) -> None:
    for name, value in model.named_parameters():
        err = (got[name] - value.detach()).abs().max().item()
        assert err <= 1e-6, f"{what}: {name} off by {err:.2e}"


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(distributed_checks, 2, timeout=TIMEOUT)


def test_init_builds_sharded_and_rank_0_modifies_what_every_rank_trains(ranks):
    ref = reference_net()
    for rank, got in enumerate(r["init"] for r in ranks):
        assert got["on_meta"], "Init built real parameters"
        assert got["held"] == 0, f"rank {rank} holds whole parameters"
        assert_close(got["built"], ref, f"rank {rank} built")
    with torch.no_grad():
        ref.fc1.weight.copy_(torch.arange(48.0).reshape(8, 6) / 100)
    losses = train_reference(ref, 2)
    for rank, got in enumerate(r["init"] for r in ranks):
        assert torch.equal(got["modified"]["fc1.weight"], torch.arange(48.0).reshape(8, 6) / 100), rank
        assert got["losses"] == pytest.approx(losses, abs=1e-6)
        assert_close(got["trained"], ref, f"rank {rank} trained")


@pytest.mark.parametrize("cls", [ExternalNet, FwdModuleNet, BlockFwdModuleNet])
def test_external_parameters_declared_as_deepspeed_documents_train_exactly(ranks, cls):
    torch.manual_seed(0)
    ref = cls()
    losses = train_reference(ref, 3)
    for rank, got in enumerate(r["external"][cls.__name__] for r in ranks):
        assert got["losses"] == pytest.approx(losses, abs=1e-6), rank
        assert_close(got["params"], ref, f"rank {rank} {cls.__name__}")


def test_a_withdrawn_external_parameter_is_an_undeclared_use_again(ranks):
    """Undeclared, the use is found at the first forward and declared then."""
    torch.manual_seed(0)
    ref = ExternalNet()
    losses = train_reference(ref, 3)
    for rank, got in enumerate(r["external"]["withdrawn"] for r in ranks):
        assert len(got["declared"]) == 1 and "'layer1.weight'" in got["declared"][0], got["declared"]
        assert got["losses"] == pytest.approx(losses, abs=1e-6), rank
        assert_close(got["params"], ref, f"rank {rank} withdrawn")


def test_unregistering_what_was_never_registered_is_refused():
    model = Net()
    with pytest.raises(zcore.InvalidArgumentError, match="not a registered external parameter"):
        zcore.zero.unregister_external_parameter(model, model.fc1.weight)
    with pytest.raises(zcore.InvalidArgumentError, match="takes a torch.nn.Parameter"):
        zcore.zero.register_external_parameter(model, torch.zeros(2))


def test_init_disabled_builds_as_usual_and_meta_parameters_cannot_be_gathered():
    with zcore.zero.Init(enabled=False):
        real = Net()
    assert not any(p.is_meta for p in real.parameters())
    with zcore.zero.GatheredParameters(real.parameters(), enabled=False) as gathered:
        assert gathered == list(real.parameters())
    with zcore.zero.Init(dtype=torch.float32):
        model = Net()
    assert all(p.is_meta for p in model.parameters())
    assert not torch.empty(1).is_meta  # the block ended
    with pytest.raises(zcore.InvalidStateError, match="meta device"):
        zcore.zero.GatheredParameters(model.fc1.weight, modifier_rank=0)


@pytest.mark.parametrize(
    "arguments, refused",
    [
        ({"mpu": object()}, "device_mesh"),
        ({"sequence_data_parallel_group": object()}, "no sequence parallelism"),
        ({"zero_quantized_nontrainable_weights": True}, "frozen weights"),
        ({"zero_quantized_weights": True}, "zero_quantized_weights to true"),
        ({"dtype": torch.int8}, "float32, bfloat16 or float16"),
        ({"dtype": torch.bfloat16, "config_dict_or_path": config()}, "compute dtype"),
        ({"config": config(stage=2)}, "only ZeRO stage 3"),
    ],
)
def test_init_refuses_what_would_change_results(arguments, refused):
    with pytest.raises(zcore.ZcoreError, match=refused):
        zcore.zero.Init(**arguments)


def test_init_accepts_deepspeed_tuning_arguments():
    with zcore.zero.Init(
        mem_efficient_linear=False, remote_device="cpu", pin_memory=True, zero_param_parallel_group=object(),
        param_swapper=object(), tensor_overrides=[], dtype=torch.bfloat16,
        config_dict_or_path={**config(), "bf16": {"enabled": True}},
    ):
        model = Net()
    assert all(p.is_meta for p in model.parameters())


def test_unwrap_model_for_generation_gathers_once_and_training_goes_on(ranks):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-4)
    x, y = data(0)
    losses = []
    for step in range(2):  # the engine's steps both train on data(0); the block runs between them
        halves = [nn.functional.cross_entropy(model(x[r * ROWS:(r + 1) * ROWS]), y[r * ROWS:(r + 1) * ROWS])
                  for r in range(2)]
        (sum(halves) / 2).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:  # the model as the block sees it
            reference = Net()
            reference.load_state_dict(model.state_dict())
        losses.append(sum(h.item() for h in halves) / 2)
    with torch.no_grad():
        expected = reference(data(100)[0])
    for got in (r["unwrap"] for r in ranks):
        assert got["is_module"] and got["gathers"] == 0  # the forwards in the block gather nothing
        assert got["held"] < sum(p.numel() for p in reference.parameters())  # released after it
        assert_close(got["params"], reference, "the model in the block")
        for out in got["outputs"]:
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        assert got["losses"] == pytest.approx(losses, rel=1e-6)


def test_a_parameter_built_with_values_under_init_keeps_them(ranks):
    """The legacy constructor's parameter is real, the rest meta; the
    engine keeps its values and initialises the rest as MetaInit does."""
    reference = LegacyScale()
    for name, module in reference.named_modules():
        if name and list(module.parameters(recurse=False)):  # the root's scale keeps its values
            torch.manual_seed(zcore.MetaInit().module_seed(name))
            module.reset_parameters()
    built = {n: p.detach().clone() for n, p in reference.named_parameters()}
    expected_losses = train_reference(reference, 2)
    for got in (r["legacy"] for r in ranks):
        assert got["on_meta"] == {"net.fc1.weight": True, "net.fc1.bias": True, "net.fc2.weight": True,
                                  "net.fc2.bias": True, "scale": False}
        assert torch.equal(got["built"]["scale"], torch.full((3,), 1.5))
        for name, value in built.items():
            assert torch.equal(got["built"][name], value), name
        assert got["losses"] == pytest.approx(expected_losses, rel=1e-6)


def test_gathered_parameters_of_two_engines_gathers_and_writes_both(ranks):
    expected = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        expected += [p.detach() for p in Net().parameters()]
    for got in (r["two engines"] for r in ranks):
        assert len(got["seen"]) == len(expected)
        for seen, value in zip(got["seen"], expected):
            assert torch.equal(seen, value)
        for model in got["written"]:
            assert all(torch.equal(v, torch.ones_like(v)) for v in model.values())
