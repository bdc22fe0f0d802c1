"""DeepSpeed's engine surface on zcore's engine, name by name.

``SURFACE`` lists every attribute and method of DeepSpeed's
``DeepSpeedEngine`` (deepspeed/runtime/engine.py, 0.19.6) that DeepSpeed's
own tutorials and API pages (DS), transformers' Trainer and
integrations/deepspeed.py (HF), Accelerate's accelerator.py and
utils/deepspeed.py (ACC) and Lightning's strategies/deepspeed.py and
plugins/precision/deepspeed.py (PL) call, with DeepSpeed's meaning and what
zcore answers; ``REFUSED``, the DeepSpeed names zcore refuses, with a phrase
of the reason it gives. One world-1 session checks every entry of both;
a world-2 run checks the 16-bit weights file against the fp32 master
weights; deepspeed.initialize's own arguments are checked last."""

from __future__ import annotations

import argparse
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import zcore
from distributed import run_ranks
from zcore.engine import deepspeed_names

MICRO, GAS = 4, 2
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
}


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def batch(i):
    gen = torch.Generator().manual_seed(i)
    return torch.randn(MICRO, 8, generator=gen), torch.randn(MICRO, 2, generator=gen)


def reference_norm():
    """The global gradient norm of the first optimizer step, from torch alone."""
    model = small_model()
    for i in range(GAS):
        x, y = batch(i)
        (nn.functional.mse_loss(model(x), y) / GAS).backward()
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))


def parameter_names(fn):
    return list(inspect.signature(fn).parameters)


def raises(fn, error, match):
    with pytest.raises(error, match=match):
        fn()
    return True


def same_tensors(got, expected):
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    return True


# name -> (callers, DeepSpeed's meaning -> zcore's answer, check(session)).
# The entries run in order; those that change the engine come last.
SURFACE = {
    # Attributes DeepSpeed's engine sets at construction.
    "module": ("DS HF ACC", "the wrapped model -> the same", lambda s: s.e.module is s.model),
    "optimizer": ("DS HF", "the ZeRO optimizer -> zcore's ShardedOptimizer, initialize's second value",
                  lambda s: s.e.optimizer is s.optimizer and s.optimizer is not None),
    "lr_scheduler": ("PL", "the scheduler; Lightning sets it to None to step it itself -> the same",
                     lambda s: s.e.lr_scheduler is s.scheduler),
    "config": ("HF", "the config as given -> zcore's validated Config (its keys are DeepSpeed's)",
               lambda s: isinstance(s.e.config, zcore.Config) and s.e.config.gradient_clipping == 1.0),
    "local_rank": ("DS", "LOCAL_RANK, the GPU index on CUDA -> the same (0 without a launcher)",
                   lambda s: s.e.local_rank == 0),
    "global_rank": ("DS", "the process group rank -> the same", lambda s: s.e.global_rank == 0),
    "world_size": ("DS", "the process group size -> the same", lambda s: s.e.world_size == 1),
    "device": ("DS", "this rank's accelerator -> its GPU (cuda:local_rank), or the CPU",
               lambda s: s.e.device == s.e.context.device
               and (s.e.device.type != "cuda" or s.e.device.index == s.e.local_rank)),
    "dp_world_size": ("DS", "the data-parallel ranks -> the same", lambda s: s.e.dp_world_size == 1),
    "mp_world_size": ("DS", "the model-parallel ranks -> a mesh's \"tp\" size, else 1",
                      lambda s: s.e.mp_world_size == 1),
    "global_steps": ("DS HF", "optimizer steps taken -> the same", lambda s: s.facts["global_steps"] == 1),
    "global_samples": ("DS", "samples consumed -> the same",
                       lambda s: s.facts["global_samples"] == MICRO * GAS),
    "skipped_steps": ("DS", "steps skipped on fp16 overflow -> the same", lambda s: s.facts["skipped"] == [0, 1]),
    "micro_steps": ("DS", "micro-batches stepped -> the same", lambda s: s.facts["micro_steps"] == GAS),
    # Forward, backward, step.
    "forward": ("DS", "the module's forward -> the same, through zcore's hooks",
                lambda s: torch.equal(s.e.forward(s.x), s.model(s.x))),
    "backward": ("DS ACC PL", "backward(loss, retain_graph=False, scale_wrt_gas=True) -> the same arguments, "
                 "and it returns the loss divided by the accumulation steps, as DeepSpeed's does",
                 lambda s: parameter_names(s.e.backward) == ["loss", "retain_graph", "scale_wrt_gas"]
                 and s.facts["retained"] and all(got == expected for got, expected in s.facts["returned"])),
    "step": ("DS ACC PL", "step(lr_kwargs=None) -> the same", lambda s: parameter_names(s.e.step) == ["lr_kwargs"]),
    "no_sync": ("DS ACC", "a block whose backward passes end no window -> the same (not refused at stages 2-3, nor "
                "a step inside: it counts the micro-step, as Accelerate's loops expect)",
                lambda s: parameter_names(s.e.no_sync) == []),
    "is_gradient_accumulation_boundary": (
        "DS", "whether the coming backward ends the window -> the same",
        lambda s: s.facts["boundaries"] == [False, True],
    ),
    "was_step_applied": ("DS", "whether the last step() updated the parameters -> the same",
                         lambda s: s.facts["applied"] == [False, True] and s.facts["overflow_applied"] == [True, False]),
    "get_global_grad_norm": (
        "ACC", "the last step's global gradient norm -> the same (None before a step, or where not measured)",
        lambda s: s.facts["norm_before"] is None and s.facts["norm"] == pytest.approx(reference_norm(), rel=1e-5),
    ),
    # Configuration queries.
    "train_batch_size": ("DS", "samples per optimizer step -> the same", lambda s: s.e.train_batch_size() == MICRO * GAS),
    "train_micro_batch_size_per_gpu": ("DS", "samples per micro-batch and rank -> the same",
                                       lambda s: s.e.train_micro_batch_size_per_gpu() == MICRO),
    "gradient_accumulation_steps": ("DS", "micro-batches per step -> the same",
                                    lambda s: s.e.gradient_accumulation_steps() == GAS),
    "get_batch_info": ("DS", "(train batch, micro batch, accumulation) -> the numbers (DeepSpeed returns the methods)",
                       lambda s: s.e.get_batch_info() == (MICRO * GAS, MICRO, GAS)),
    "zero_stage": ("zcore", "zcore's own property -> the ZeRO stage", lambda s: s.e.zero_stage == 2),
    "zero_optimization_stage": ("DS", "the ZeRO stage -> the same", lambda s: s.e.zero_optimization_stage() == 2),
    "zero_optimization": ("DS", "whether ZeRO is on (stage > 0) -> the same", lambda s: s.e.zero_optimization() is True),
    "zero_optimization_partition_gradients": ("DS", "stage >= 2 -> the same",
                                              lambda s: s.e.zero_optimization_partition_gradients() is True),
    "zero_optimization_partition_weights": ("DS", "stage 3 -> the same",
                                            lambda s: s.e.zero_optimization_partition_weights() is False),
    "zero_gather_16bit_weights_on_model_save": (
        "ACC", "whether save_16bit_model gathers at stage 3 -> True: zcore's always does, streamed",
        lambda s: s.e.zero_gather_16bit_weights_on_model_save() is True,
    ),
    "fp16_enabled": ("DS", "fp16.enabled -> the same", lambda s: s.e.fp16_enabled() is False and s.facts["fp16"]),
    "bfloat16_enabled": ("DS", "bf16.enabled -> the same", lambda s: s.e.bfloat16_enabled() is False),
    "gradient_clipping": ("DS", "gradient_clipping -> the same", lambda s: s.e.gradient_clipping() == 1.0),
    "steps_per_print": ("DS", "steps_per_print -> the same", lambda s: s.e.steps_per_print() == 10),
    "wall_clock_breakdown": ("DS", "wall_clock_breakdown -> the same", lambda s: s.e.wall_clock_breakdown() is False),
    "get_data_parallel_rank": ("DS", "this rank among the data-parallel ranks -> the same",
                               lambda s: s.e.get_data_parallel_rank() == 0),
    "get_model_parallel_rank": ("DS", "this rank among the model-parallel ranks -> its \"tp\" rank, else 0",
                                lambda s: s.e.get_model_parallel_rank() == 0),
    "get_tensor_parallel_rank": ("DS", "this rank among the tensor-parallel ranks -> the same",
                                 lambda s: s.e.get_tensor_parallel_rank() == 0),
    "get_lr": ("DS", "each group's lr -> the same", lambda s: s.e.get_lr() == [pytest.approx(0.05)]),
    "get_mom": ("DS", "each group's betas (momentum for SGD) -> the same", lambda s: s.e.get_mom() == [(0.9, 0.999)]),
    "loss_scale": (
        "DS", "loss_scale(): the configured fp16.loss_scale -> zcore's property, the current scale; calling it "
        "says so",
        lambda s: s.e.loss_scale == 1.0 and s.facts["fp16_scale"] == 2.0**16
        and raises(lambda: s.e.loss_scale(), TypeError, r"engine.config.fp16.loss_scale"),
    ),
    # torch.nn.Module's names, which DeepSpeed's engine (a Module) answers with 'module.' before each name:
    # zcore's engine passes them to the module, so the names are the module's own.
    "parameters": ("DS", "the module's parameters -> the same",
                   lambda s: list(s.e.parameters()) == list(s.model.parameters())),
    "named_parameters": ("DS", "'module.NAME' -> NAME, the module's own names",
                         lambda s: [n for n, _ in s.e.named_parameters()] == [n for n, _ in s.model.named_parameters()]),
    # Modes, gradients, memory.
    "train": ("DS", "module.train(mode) -> the same", lambda s: s.e.train() is s.e and s.model.training),
    "eval": ("DS", "module.train(False) -> the same",
             lambda s: s.e.eval() is s.e and not s.model.training and s.e.train() is s.e),
    "zero_grad": ("DS", "param.grad = None on every parameter -> the same", lambda s: s.zero_grad()),
    "set_gradient_accumulation_boundary": (
        "DS HF ACC", "set_gradient_accumulation_boundary(is_boundary) -> the same",
        lambda s: parameter_names(s.e.set_gradient_accumulation_boundary) == ["is_boundary"] and s.boundary_set(),
    ),
    "empty_partition_cache": ("DS", "release gathered parameters (stage 3) -> the same; a no-op at stages 0-2",
                              lambda s: s.e.empty_partition_cache() is None),
    # Checkpoints.
    "save_checkpoint": (
        "DS HF ACC PL", "save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters) -> "
        "the same names, and zcore's keyword async_save; save_latest=False refused; frozen parameters written all "
        "the same",
        lambda s: parameter_names(s.e.save_checkpoint)
        == ["save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters", "async_save"]
        and s.save_checkpoint(),
    ),
    "load_checkpoint": (
        "DS HF ACC PL", "load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states, "
        "load_lr_scheduler_states, load_module_only, custom_load_fn) -> the same names; load_module_strict=False "
        "and custom_load_fn refused",
        lambda s: parameter_names(s.e.load_checkpoint) == [
            "load_dir", "tag", "load_module_strict", "load_optimizer_states", "load_lr_scheduler_states",
            "load_module_only", "custom_load_fn",
        ] and s.load_checkpoint(),
    ),
    "save_16bit_model": (
        "DS", "save_16bit_model(save_dir, save_filename='pytorch_model.bin', exclude_frozen_parameters=False): "
        "the weights in the compute dtype -> the same, streamed (torch file, or safetensors by name)",
        lambda s: parameter_names(s.e.save_16bit_model) == ["save_dir", "save_filename", "exclude_frozen_parameters"]
        and s.save_16bit_model(),
    ),
    "save_fp16_model": ("DS", "the former name of save_16bit_model -> the same", lambda s: s.save_fp16_model()),
    "_zero3_consolidated_16bit_state_dict": (
        "HF ACC", "the 16-bit state dict on rank 0, None elsewhere -> the same, at every stage",
        lambda s: same_tensors(s.e._zero3_consolidated_16bit_state_dict(), s.e.full_state_dict()),
    ),
    "compile": (
        "DS", "torch.compile the model -> the same (stage 3: each block, gathered whole; tests/python/test_compile.py)",
        lambda s: {"backend", "compile_kwargs"} <= set(inspect.signature(s.e.compile).parameters),
    ),
    "is_compiled": ("DS", "whether the model runs compiled -> the same", lambda s: s.e.is_compiled is False),
    "destroy": ("ACC", "release the engine's resources -> the same; it cannot train after",
                lambda s: s.e.destroy() is None and raises(lambda: s.e.backward(s.e(s.x).sum()), zcore.InvalidStateError,
                                                           "destroyed")),
}

# DeepSpeed names zcore refuses (an AttributeError naming the name and what zcore does instead) -> a phrase of it.
REFUSED = {
    "coalesce_grad_reduction": "engine.backward",
    "scale": "scale_wrt_gas=False",
    "offload_states": "offload_optimizer",
    "reload_states": "nothing to reload",
    "module_state_dict": "full_state_dict",
    "training_dataloader": "third value",
    "deepspeed_io": "DistributedSampler",
    "set_train_batch_size": "new engine",
    "set_train_micro_batch_size": "new engine",
}


class Session:
    """A trained engine and what was seen while it trained."""

    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self.model = small_model()
        self.engine_and_facts()

    def engine_and_facts(self) -> None:
        def adamw(groups):
            return torch.optim.AdamW(groups, lr=0.1)

        config = {**CONFIG, "steps_per_print": 10}
        self.e, self.optimizer, _, self.scheduler = zcore.initialize(
            model=self.model, config=config, optimizer=adamw,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
        )
        e, facts = self.e, {"boundaries": [], "applied": []}
        self.facts = facts
        facts["norm_before"] = e.get_global_grad_norm()
        for i in range(GAS):
            x, y = batch(i)
            facts["boundaries"].append(e.is_gradient_accumulation_boundary())
            loss = nn.functional.mse_loss(e(x), y)
            facts.setdefault("returned", []).append((e.backward(loss, retain_graph=True).item(), loss.item() / GAS))
            e.step()
            facts["applied"].append(e.was_step_applied())
        facts["retained"] = loss.grad_fn is not None
        facts["norm"] = e.get_global_grad_norm()
        facts.update(global_steps=e.global_steps, global_samples=e.global_samples, micro_steps=e.micro_steps)
        self.x = batch(0)[0]
        self.fp16_facts()

    def fp16_facts(self) -> None:
        """was_step_applied and skipped_steps across an fp16 overflow."""
        model = small_model()
        config = {"train_micro_batch_size_per_gpu": MICRO, "fp16": {"enabled": True}, "optimizer": {"type": "AdamW"}}
        e, *_ = zcore.initialize(model=model, config=config)
        x = batch(0)[0].half()
        self.facts["fp16"] = e.fp16_enabled()
        self.facts["fp16_scale"] = e.loss_scale
        applied, skipped = [], []
        for factor in (1e-3, math.inf):
            e.backward(e(x).float().square().mean() * factor)
            e.step()
            applied.append(e.was_step_applied())
            skipped.append(e.skipped_steps)
        self.facts.update(overflow_applied=applied, skipped=skipped)
        e.destroy()

    def zero_grad(self) -> bool:
        for p in self.model.parameters():
            p.grad = torch.ones_like(p)
        self.e.zero_grad()
        return all(p.grad is None for p in self.model.parameters())

    def boundary_set(self) -> bool:
        self.e.set_gradient_accumulation_boundary(is_boundary=True)
        return self.e.is_gradient_accumulation_boundary() is True

    def save_checkpoint(self) -> bool:
        raises(lambda: self.e.save_checkpoint(self.dir / "ckpt", save_latest=False), zcore.InvalidArgumentError,
               r"save_latest=False")
        path = self.e.save_checkpoint(self.dir / "ckpt", tag="t", client_state={"epoch": 2},
                                      save_latest=True, exclude_frozen_parameters=True)
        return path == self.dir / "ckpt" / "t" and (self.dir / "ckpt" / "latest").read_text() == "t"

    def load_checkpoint(self) -> bool:
        root = self.dir / "ckpt"
        raises(lambda: self.e.load_checkpoint(root, load_module_strict=False), zcore.InvalidArgumentError,
               r"load_module_strict=False")
        raises(lambda: self.e.load_checkpoint(root, custom_load_fn=print), zcore.InvalidArgumentError, r"custom_load_fn")
        path, client = self.e.load_checkpoint(root, None, True, True, False, False, None)  # DeepSpeed's order
        return path == root / "t" and client == {"epoch": 2}

    def save_16bit_model(self) -> bool:
        raises(lambda: self.e.save_16bit_model(self.dir, "sub/x.bin"), zcore.InvalidArgumentError, "save_filename")
        expected = self.e.full_state_dict()  # fp32 training: the weights in fp32, as DeepSpeed writes them
        assert self.e.save_16bit_model(self.dir / "weights") is True
        from safetensors.torch import load_file

        assert self.e.save_16bit_model(self.dir / "weights", "model.safetensors") is True
        return same_tensors(torch.load(self.dir / "weights" / "pytorch_model.bin", weights_only=True), expected) and \
            same_tensors(load_file(self.dir / "weights" / "model.safetensors"), expected)

    def save_fp16_model(self) -> bool:
        assert self.e.save_fp16_model(self.dir / "old", "w.bin") is True
        return same_tensors(torch.load(self.dir / "old" / "w.bin", weights_only=True), self.e.full_state_dict())


def check_every_name(rank, world, directory):
    s = Session(directory)
    failures = {}
    for name, (_, _, check) in SURFACE.items():
        try:
            if check(s) is not True:
                failures[name] = "the check returned False"
        except Exception as exc:  # noqa: BLE001 - reported by name
            failures[name] = f"{type(exc).__name__}: {exc}"
    engine, *_ = zcore.initialize(model=small_model(), config=CONFIG, optimizer=lambda g: torch.optim.SGD(g, lr=0.1))
    for name, phrase in REFUSED.items():
        try:
            getattr(engine, name)
        except AttributeError as exc:
            if f"engine.{name} is DeepSpeed's" not in str(exc) or phrase not in str(exc):
                failures[name] = f"refused without its reason: {exc}"
        else:
            failures[name] = "answered instead of refused"
        if hasattr(engine, name):
            failures[name] = "hasattr is True for a refused name"
    return sorted(SURFACE), failures


def test_every_deepspeed_name_is_answered_or_refused(tmp_path):
    names, failures = run_ranks(check_every_name, 1, str(tmp_path), launcher=False, timeout=120)[0]
    assert names == sorted(SURFACE)
    assert failures == {}


def test_the_tables_cover_the_surface():
    """Every public name of zcore's DeepSpeed surface is in SURFACE, and the
    refusals are exactly the module's: the tables cannot drift from the code."""
    declared = {n for n in vars(deepspeed_names.DeepSpeedEngineNames) if not n.startswith("__")}
    declared -= {"_trainer", "_finish_step", "_compute_dtype"}  # the engine's own, and a helper
    assert declared - set(SURFACE) == set()
    assert set(REFUSED) == set(deepspeed_names.REFUSED)
    assert set(SURFACE).isdisjoint(REFUSED)


class Tied(nn.Module):
    """An embedding tied to the head, a frozen bias and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(12, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight
        self.mid.bias.requires_grad_(False)
        self.register_buffer("gain", torch.full((8,), 1.5))

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids)) * self.gain))


def save_16bit_on_two_ranks(rank, world, directory, stage):
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True, "cast_buffers": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "zero_optimization": {"stage": stage}}
    engine, *_ = zcore.initialize(model=Tied(), config=config)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, 12, (2, 5), generator=gen)
        engine.backward(engine(ids).float().logsumexp(-1).mean())
        engine.step()
    out = Path(directory) / f"stage{stage}"
    saved = [
        engine.save_16bit_model(out),
        engine.save_16bit_model(out, "model.safetensors"),
        engine.save_16bit_model(out, "trained.bin", exclude_frozen_parameters=True),
    ]
    full = engine.full_state_dict()  # fp32 master weights, on rank 0
    consolidated = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    engine.empty_partition_cache()
    engine.backward(engine(torch.zeros(2, 5, dtype=torch.long)).float().mean())  # still trains after it
    engine.step()
    if rank != 0:
        return saved, consolidated
    from safetensors.torch import load_file

    files = {
        "bin": torch.load(out / "pytorch_model.bin", weights_only=True),
        "safetensors": load_file(out / "model.safetensors"),
        "trained": torch.load(out / "trained.bin", weights_only=True),
    }
    tied = files["bin"]["head.weight"].untyped_storage().data_ptr() == files["bin"]["embed.weight"].untyped_storage().data_ptr()
    return saved, consolidated, files, full, tied  # (sharing is known here only: pickling the results copies)


@pytest.mark.parametrize("stage", [1, 3])
def test_save_16bit_model_writes_the_master_weights_in_bf16_on_two_ranks(tmp_path, stage):
    (saved, consolidated, files, full, tied), (saved_1, consolidated_1) = run_ranks(
        save_16bit_on_two_ranks, 2, str(tmp_path), stage, timeout=120
    )
    assert saved == saved_1 == [True, True, True] and consolidated_1 is None
    expected = {key: value.to(torch.bfloat16) for key, value in full.items()}
    assert sorted(expected) == ["embed.weight", "gain", "head.weight", "mid.bias", "mid.weight"]
    # The torch file holds every key of the state dict, the tied ones over one storage, as torch.save writes.
    same_tensors(files["bin"], expected)
    assert tied
    # safetensors keeps a tied tensor once, under its first name, as transformers writes it.
    same_tensors(files["safetensors"], {k: v for k, v in expected.items() if k != "head.weight"})
    trained = {k: v for k, v in expected.items() if k != "mid.bias"}
    same_tensors(files["trained"], trained)
    same_tensors(consolidated, trained)


# deepspeed.initialize's own arguments.


def check_initialize_arguments(rank, world, directory):
    with pytest.raises(zcore.InvalidStateError, match=r"dist_init_required=False"):
        zcore.initialize(model=small_model(), config=CONFIG, dist_init_required=False)  # no process group yet
    path = Path(directory) / "ds_config.json"
    path.write_text(json.dumps({**CONFIG, "optimizer": {"type": "AdamW"}}))
    args = argparse.Namespace(local_rank=-1, deepspeed_config=str(path))
    engine, *_ = zcore.initialize(model=small_model(), args=args, dist_init_required=True)
    assert engine.gradient_clipping() == 1.0 and args.local_rank == 0  # set to the rank zcore uses, as DeepSpeed
    with pytest.raises(zcore.ConfigError, match=r"both as config and as args.deepspeed_config"):
        zcore.initialize(model=small_model(), config=CONFIG, args=args)
    with pytest.raises(zcore.ConfigError, match=r"both as config and as config_params"):
        zcore.initialize(model=small_model(), config=CONFIG, config_params=CONFIG)
    with pytest.raises(zcore.ConfigError, match=r"needs a config"):
        zcore.initialize(model=small_model(), args=argparse.Namespace(local_rank=0))
    with pytest.raises(zcore.InvalidArgumentError, match=r"args.local_rank is 3"):
        zcore.initialize(model=small_model(), args=argparse.Namespace(local_rank=3, deepspeed_config=str(path)))
    with pytest.raises(zcore.InvalidArgumentError, match=r"dist_init_required"):
        zcore.initialize(model=small_model(), config=CONFIG, dist_init_required="yes")
    engine, *_ = zcore.initialize(model=small_model(), config_params={**CONFIG, "optimizer": {"type": "AdamW"}},
                                  dist_init_required=False)
    assert engine.zero_optimization_stage() == 2
    # Lightning's inference engine: args.device_rank (None on the CPU) and model_parameters=[].
    engine, optimizer, _, _ = zcore.initialize(
        model=small_model(), args=argparse.Namespace(device_rank=engine.device.index),
        config={"train_micro_batch_size_per_gpu": 1}, model_parameters=[], optimizer=None, lr_scheduler=None,
    )
    assert optimizer is None and engine(batch(0)[0]).shape == (MICRO, 2)
    return True


def test_initialize_takes_deepspeeds_arguments(tmp_path):
    assert run_ranks(check_initialize_arguments, 1, str(tmp_path), launcher=False, timeout=120) == [True]
