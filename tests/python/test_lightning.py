"""Lightning's Trainer on zcore (zcore.lightning.ZcoreStrategy) at world 2
on the CPU, against Lightning's own DDP strategy over gloo on the same
module, seed and data.

One spawn of two ranks runs every scenario (``runs``, module-scoped) and
the tests read its results: Lightning takes seconds to import per rank.
Each fit is 20 optimizer steps of a tiny GPT, 2 micro-batches accumulated
(an epoch is 7 micro-batches per rank, so every fourth step closes a
shorter accumulation, as Lightning steps at an epoch's end), clipped to a
norm the gradients exceed, with a step-wise LR schedule. Both build the
model with the same deterministic weights (``fill``): eagerly for DDP, and
at stage 3 on the meta device in ``configure_model``, materialised by
zcore.MetaInit straight into shards.

Tolerance: both run fp32 AdamW on the same data. Unclipped, zcore's
losses are DDP's bit for bit (measured); clipped, the global norm is summed
in another order (zcore's shards against torch's per-tensor norms), ~2e-7
relative, which moves the clip coefficient by an ulp: the losses of the 35
micro-batches agree within 1e-5 (measured 4.8e-7, an ulp of the loss).
Lightning's DeepSpeed strategy is no second reference here: it refuses any
accelerator but CUDA (``DeepSpeedStrategy.setup_environment``).
"""

from __future__ import annotations

import ast
import logging
import math
import os
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from models import TinyGPT
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader
from zcore import MetaInit
from zcore.cli import main
from zcore.errors import ConfigError, ZcoreError
from zcore.lightning import (
    ZcoreStrategy,  # and registers the strategy names, in the ranks too
)

TIMEOUT = 600
WORLD, MICRO, GAS, STEPS, STOP = 2, 2, 2, 20, 8
SAMPLES, EVAL_SAMPLES, LENGTH = 28, 8, 17  # 7 micro-batches per rank per epoch
CLIP = 0.5
LR = 5e-3


def fill(module: nn.Module) -> None:
    """Deterministic weights that depend on shapes only (a generator seeded
    by the size), the same eagerly or through zcore.MetaInit, which calls it
    on each module as it materialises it."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        with torch.no_grad():
            generator = torch.Generator().manual_seed(module.weight.numel())
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.02)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (n, LENGTH), generator=torch.Generator().manual_seed(seed))


class GPTModule(L.LightningModule):
    """The GPT built in configure_model (at stage 3: on the meta device), or
    in __init__ with ``eager=True``; every micro-batch's loss kept."""

    def __init__(self, eager: bool = False, optimizer: str = "adamw") -> None:
        super().__init__()
        self.gpt = self.build() if eager else None
        self.optimizer_kind = optimizer
        self.losses: list[float] = []
        self.grad_norms: list[float] = []  # each optimizer step's, before clipping
        self.lrs: list[float] = []  # each optimizer step's
        self.built_on_meta: list[bool] = []

    def build(self) -> nn.Module:
        gpt = TinyGPT()
        gpt.apply(fill)  # on the meta device: nothing, zcore.MetaInit fills it
        return gpt

    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = self.build()
            self.built_on_meta.append(all(p.is_meta for p in self.gpt.parameters()))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]  # DDP's; zcore's are its shards
        if grads:
            self.grad_norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None and engine.last_step_applied:
            self.grad_norms.append(engine.last_grad_norm)
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.gpt(batch[:, :-1]).float()

    def configure_optimizers(self):
        if self.optimizer_kind == "config":
            return None  # the zcore config's
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(tokens(SAMPLES, 1), batch_size=MICRO, shuffle=False)

    def val_dataloader(self):
        return DataLoader(tokens(EVAL_SAMPLES, 2), batch_size=MICRO)

    def test_dataloader(self):
        return DataLoader(tokens(EVAL_SAMPLES, 3), batch_size=MICRO)

    def predict_dataloader(self):
        return DataLoader(tokens(EVAL_SAMPLES, 4), batch_size=MICRO)


def trainer(strategy, root, steps=STEPS, **extra):
    """``check_val_every_n_epoch=100``: no validation inside the fits (the
    evaluations are the tests' own calls)."""
    settings = dict(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, accumulate_grad_batches=GAS,
        gradient_clip_val=CLIP, check_val_every_n_epoch=100, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(root),
    )
    return L.Trainer(**{**settings, **extra})


def zcore_strategy(stage, **extra):
    return ZcoreStrategy(stage=stage, meta_init=MetaInit(init_fn=fill), **extra)


def weights(module, strategy):
    """The whole model's fp32 weights, on every rank."""
    engine = getattr(strategy, "engine", None)
    if engine is None:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    full = engine.full_state_dict()
    gathered = [full]
    torch.distributed.broadcast_object_list(gathered, src=0)
    return gathered[0]


def fit(strategy, root, eager=False, steps=STEPS, ckpt_path=None, module=None, **extra):
    module = module if module is not None else GPTModule(eager=eager)
    run = trainer(strategy, root, steps=steps, **extra)
    run.fit(module, ckpt_path=ckpt_path)
    return module, run


def refusal(action):
    try:
        action()
    except ZcoreError as exc:
        return str(exc)
    return None


def reference(root):
    """Lightning's DDP strategy: the fit, then validate, test and predict."""
    module, run = fit("ddp", root, eager=True)
    return {"losses": module.losses, "grad_norms": module.grad_norms, "weights": weights(module, run.strategy),
            "val": run.validate(module, verbose=False)[0]["val_loss"],
            "test": run.test(module, verbose=False)[0]["test_loss"],
            "predict": torch.cat(run.predict(module))}


def stage_run(stage, root):
    """Stages 1 and 2 by their registered names; stage 3 with the MetaInit
    that gives configure_model's meta model the reference's weights."""
    module, run = fit(zcore_strategy(3) if stage == 3 else f"zcore_stage_{stage}", root)
    engine = run.strategy.engine
    out = {"losses": module.losses, "grad_norms": module.grad_norms, "weights": weights(module, run.strategy),
           "built_on_meta": module.built_on_meta, "lr": run.optimizers[0].param_groups[0]["lr"],
           "stage": engine.config.zero_optimization.stage, "skipped": engine.skipped_steps,
           "global_steps": engine.global_steps}
    if stage == 3:  # evaluations on the engine the fit trained, and what cannot follow a fit
        out["val"] = run.validate(module, verbose=False)[0]["val_loss"]
        out["test"] = run.test(module, verbose=False)[0]["test_loss"]
        out["predict"] = torch.cat(run.predict(module))
        out["refused"] = {"second fit": refusal(lambda: run.fit(module)),
                          "weights only": refusal(lambda: run.save_checkpoint(root / "w.ckpt", weights_only=True))}
    return out


def stop_and_resume(root):
    """A run stopped after 8 steps, its checkpoints written by
    ModelCheckpoint every 4 steps (the one of step 4 then removed, as it
    keeps the latest); resumed from the last with ckpt_path; evaluated from
    it by a new module and Trainer. The module is built in __init__ here,
    then sharded by zcore. (Both checkpoints end an epoch: Lightning restarts
    an epoch's loader from its start, so a checkpoint inside an epoch would
    not repeat the run, with any strategy.)"""
    saving = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=4)
    module, run = fit(zcore_strategy(3), root / "stopped", eager=True, steps=STOP,
                      enable_checkpointing=True, callbacks=[saving])
    torch.distributed.barrier()  # rank 0 removes the step-4 checkpoint after the step-8 save
    files = sorted(p.name for p in (root / "checkpoints").iterdir())
    checkpoint = root / "checkpoints" / files[-1]
    out = {"checkpoint": checkpoint, "stopped": {"files": files, "losses": module.losses,
                                                 "weights": weights(module, run.strategy),
                                                 "val": run.validate(module, verbose=False)[0]["val_loss"]}}
    module, run = fit(zcore_strategy(3), root / "resumed", eager=True, ckpt_path=checkpoint)
    out["resumed"] = {"losses": module.losses, "weights": weights(module, run.strategy), "global_step": run.global_step}
    fresh, evaluator = GPTModule(), trainer(zcore_strategy(3), root / "fresh")
    out["fresh"] = {"val": evaluator.validate(fresh, ckpt_path=checkpoint, verbose=False)[0]["val_loss"],
                    "has_optimizer": evaluator.strategy.engine.optimizer is not None}
    return out


def precisions_and_names(root):
    """bf16-mixed and 16-mixed (on a CPU, through the plugin: Lightning
    turns precision="16-mixed" into bf16 there); the registered offload
    name; the config's optimizer and schedule."""
    out = {}
    for name, extra in (("bf16", {"precision": "bf16-mixed"}),
                        ("fp16", {"plugins": [MixedPrecision("16-mixed", "cpu")]})):
        module, run = fit(zcore_strategy(2), root / name, steps=4, **extra)
        config = run.strategy.engine.config
        out[name] = {"enabled": getattr(config, name).enabled, "dtype": module.gpt.lm_head.weight.dtype,
                     "precision": type(run.precision_plugin).__name__, "losses": module.losses}
    module, run = fit("zcore_stage_3_offload", root / "offload", eager=True, steps=4)
    zero = run.strategy.engine.config.zero_optimization
    out["offload"] = {"devices": (zero.offload_optimizer.device, zero.offload_param.device, zero.stage),
                      "losses": module.losses}
    config = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR,
                                                            "warmup_num_steps": 4, "warmup_type": "linear"}}}
    module = GPTModule(optimizer="config")
    run = trainer(zcore_strategy(2, config=config), root / "config", steps=4)
    run.fit(module)
    out["config optimizer"] = {"lrs": module.lrs, "losses": module.losses}
    return out


def refusals(root):
    """What zcore refuses when the Trainer sets up, on every rank alike."""
    manual = GPTModule()
    manual.automatic_optimization = False
    both = GPTModule()
    config = {"optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    return {
        "clip by value": refusal(lambda: fit(zcore_strategy(2), root / "r1", steps=1, gradient_clip_algorithm="value")),
        "accumulation": refusal(lambda: fit(
            zcore_strategy(2, config={"gradient_accumulation_steps": 4}), root / "r2", steps=1)),
        "not a zcore checkpoint": refusal(lambda: fit(zcore_strategy(2), root / "r3", steps=1, ckpt_path=__file__)),
        "manual optimization": refusal(lambda: trainer(zcore_strategy(2), root / "r4", steps=1,
                                                       gradient_clip_val=None, accumulate_grad_batches=1).fit(manual)),
        "optimizer twice": refusal(lambda: trainer(zcore_strategy(2, config=config), root / "r5", steps=1).fit(both)),
    }


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "lightning.md"


def guide_example(root):
    """The guide's first example as written, with ``module`` bound, in a
    directory of its own (it saves to a relative path)."""
    (snippet, *_) = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    names = {"module": GPTModule()}
    (root / "guide").mkdir(exist_ok=True)  # by either rank
    os.chdir(root / "guide")
    exec(snippet, names)
    run = names["trainer"]
    return {"steps": run.global_step, "bf16": run.strategy.engine.config.bf16.enabled,
            "stage": run.strategy.engine.config.zero_optimization.stage,
            "saved": sorted(p.name for p in (root / "guide" / "final.ckpt").iterdir())}


def scenarios(rank, world, root):
    """Every run of this file at world 2, in one spawn of the ranks."""
    out = {"ddp": reference(root / "ddp")}
    out.update({stage: stage_run(stage, root / f"stage{stage}") for stage in (1, 2, 3)})
    out.update(stop_and_resume(root))
    out.update(precisions_and_names(root))
    out["refused"] = {**refusals(root), **out[3].pop("refused")}
    out["guide"] = guide_example(root)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(scenarios, WORLD, tmp_path_factory.mktemp("lightning"), timeout=TIMEOUT)


def micro_batches(steps):
    """Micro-batches a rank runs in ``steps`` optimizer steps: per epoch, 3
    steps of 2 and a last one of 1."""
    epochs, rest = divmod(steps, 4)
    return 7 * epochs + GAS * rest


def assert_losses_close(got, expected, what):
    assert len(got) == len(expected) == micro_batches(STEPS), what
    worst = max(abs(a - b) for a, b in zip(got, expected))
    assert worst < 1e-5, (what, worst)


def assert_weights_close(got, expected, what, atol=1e-5):
    assert got.keys() == expected.keys(), what
    for key in expected:
        assert (got[key] - expected[key]).abs().max().item() < atol, (what, key)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zcore_stages_train_as_lightning_ddp(runs, stage):
    for rank in range(WORLD):
        ddp, got = runs[rank]["ddp"], runs[rank][stage]
        assert_losses_close(got["losses"], ddp["losses"], (stage, rank))
        assert got["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-5)
        assert_weights_close(got["weights"], ddp["weights"], (stage, rank))
        assert (got["stage"], got["global_steps"], got["skipped"]) == (stage, STEPS, 0)
        assert got["lr"] == pytest.approx(LR)  # the module's warm-up schedule, stepped by Lightning to its end
    # Clipping acted at most steps (else it went untested).
    assert sum(norm > CLIP for norm in ddp["grad_norms"]) >= STEPS // 2


def test_stage_3_builds_the_model_on_the_meta_device_in_configure_model(runs):
    for rank in range(WORLD):
        assert runs[rank][3]["built_on_meta"] == [True]
        assert runs[rank][1]["built_on_meta"] == [False]


def test_stage_3_validates_tests_and_predicts_after_the_fit_as_ddp(runs):
    for rank in range(WORLD):
        ddp, got = runs[rank]["ddp"], runs[rank][3]
        assert got["val"] == pytest.approx(ddp["val"], rel=1e-5)
        assert got["test"] == pytest.approx(ddp["test"], rel=1e-5)
        assert got["predict"].shape == ddp["predict"].shape
        assert (got["predict"] - ddp["predict"]).abs().max().item() < 1e-4


def test_a_run_stopped_and_resumed_from_its_checkpoint_repeats_the_uninterrupted_one(runs):
    for rank in range(WORLD):
        uninterrupted, stopped, resumed = runs[rank][3], runs[rank]["stopped"], runs[rank]["resumed"]
        before = micro_batches(STOP)
        assert stopped["files"] == [f"epoch=1-step={STOP}.ckpt"]
        assert stopped["losses"] == pytest.approx(uninterrupted["losses"][:before], abs=1e-6)
        assert resumed["global_step"] == STEPS
        assert resumed["losses"] == pytest.approx(uninterrupted["losses"][before:], abs=1e-6)
        assert_weights_close(resumed["weights"], uninterrupted["weights"], rank, atol=1e-6)


def test_a_new_module_and_trainer_evaluate_from_the_checkpoint_without_an_optimizer(runs):
    for rank in range(WORLD):
        stopped, fresh = runs[rank]["stopped"], runs[rank]["fresh"]
        assert fresh["has_optimizer"] is False
        assert fresh["val"] == pytest.approx(stopped["val"], rel=1e-6)


def test_zcore_consolidate_writes_the_modules_state_dict(runs, tmp_path):
    assert main(["consolidate", str(runs[0]["checkpoint"]), str(tmp_path)]) == 0
    state = load_file(tmp_path / "model.safetensors")
    stopped = runs[0]["stopped"]["weights"]
    assert sorted(state) == sorted(stopped)
    for key, value in state.items():
        assert torch.equal(value, stopped[key]), key


def test_bf16_and_16_mixed_are_zcore_mixed_precision(runs):
    fp32 = runs[0][2]["losses"]
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        got = runs[0][name]
        assert got["enabled"] and got["dtype"] == dtype and got["precision"] == "ZcorePrecision", name
        # The fp32 run's first steps, within the half dtype's rounding.
        assert got["losses"] == pytest.approx(fp32[: len(got["losses"])], rel=2e-2), name


def test_the_registered_offload_name_offloads_both_and_trains_as_ddp(runs):
    got = runs[0]["offload"]
    assert got["devices"] == ("cpu", "cpu", 3)
    assert got["losses"] == pytest.approx(runs[0]["ddp"]["losses"][: len(got["losses"])], abs=1e-5)


def test_the_configs_optimizer_and_schedule_train_with_lightning_stepping_the_schedule(runs):
    got = runs[0]["config optimizer"]
    # DeepSpeed's WarmupLR, linear over 4 steps: built at its iteration 0
    # (lr 0), and Lightning steps it after each optimizer step, as DeepSpeed's
    # engine does: step k runs at iteration k - 1.
    assert got["lrs"] == pytest.approx([LR * (k - 1) / 4 for k in range(1, 5)])
    assert len(got["losses"]) == micro_batches(4) and all(math.isfinite(loss) for loss in got["losses"])


def test_the_guide_example_runs_as_written(runs):
    got = runs[0]["guide"]
    assert (got["steps"], got["bf16"], got["stage"]) == (3 * 4, True, 3)  # max_epochs=3 of 4 steps
    assert got["saved"] == ["latest", "zcore"]


@pytest.mark.parametrize("name,expected", [
    ("clip by value", "gradient_clip_algorithm='value'"),
    ("accumulation", "gradient_accumulation_steps is 4 but Trainer(accumulate_grad_batches) gives 2"),
    ("not a zcore checkpoint", "is not a checkpoint ZcoreStrategy saved"),
    ("manual optimization", "uses manual optimization"),
    ("optimizer twice", "returns an optimizer too: keep one"),
    ("second fit", "a fit cannot wrap it again"),
    ("weights only", "save_weights_only=True"),
])
def test_what_zcore_cannot_honour_is_refused_with_the_reason(runs, name, expected):
    for rank in range(WORLD):
        message = runs[rank]["refused"][name]
        assert message is not None and expected in message, (name, message)


class SkippingModule(GPTModule):
    def training_step(self, batch, batch_idx):
        return None


def at_world_1(rank, world, checkpoint, root):
    """The world-2 checkpoint at world 1: evaluated, then trained on."""
    evaluator = trainer(zcore_strategy(3), root / "evaluate", devices=1)
    val = evaluator.validate(GPTModule(), ckpt_path=checkpoint, verbose=False)[0]["val_loss"]
    module, run = fit(zcore_strategy(3), root / "resume", eager=True, devices=1, steps=STOP + 2, ckpt_path=checkpoint)
    skipped = refusal(lambda: fit(zcore_strategy(2), root / "skip", devices=1, steps=1, accumulate_grad_batches=1,
                                  module=SkippingModule()))
    return val, run.global_step, run.strategy.engine.global_steps, module.losses, skipped


def test_the_checkpoint_loads_at_another_world_size(runs, tmp_path):
    val, lightning_steps, zcore_steps, losses, skipped = run_ranks(
        at_world_1, 1, runs[0]["checkpoint"], tmp_path, timeout=TIMEOUT)[0]
    # One rank sees the 8 validation samples the two ranks shared: the same mean.
    assert val == pytest.approx(runs[0]["stopped"]["val"], rel=1e-6)
    assert lightning_steps == zcore_steps == STOP + 2
    # Lightning's loop state is the world-2 run's (its data order follows the new world).
    assert 2 <= len(losses) <= 2 * GAS and all(math.isfinite(loss) for loss in losses)
    assert "training_step returned None" in skipped


def test_the_strategy_names_are_registered_when_zcore_lightning_is_imported():
    expected = {"zcore": {}, "zcore_stage_1": {"stage": 1}, "zcore_stage_2": {"stage": 2},
                "zcore_stage_3": {"stage": 3},
                "zcore_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True}}
    for name, arguments in expected.items():
        assert StrategyRegistry[name]["init_params"] == arguments, name
        assert isinstance(L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False).strategy, ZcoreStrategy)


def test_import_zcore_does_not_import_lightning():
    """Only zcore.lightning imports Lightning, and no zcore module imports
    it: the names are registered when a user imports zcore.lightning."""
    package = Path(__file__).resolve().parents[2] / "python" / "zcore"
    importers = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.split(".")[0] in ("lightning", "pytorch_lightning") or name == "zcore.lightning":
                    importers.setdefault(path.relative_to(package).as_posix(), set()).add(name.split(".")[0])
    assert importers == {"lightning.py": {"lightning"}}


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_precisions_zcore_does_not_have_are_refused_when_the_trainer_is_built(precision):
    with pytest.raises(ConfigError, match="zcore keeps fp32 master weights"):
        L.Trainer(strategy=ZcoreStrategy(), accelerator="cpu", devices=1, precision=precision, logger=False)


def test_a_checkpoint_io_plugin_is_refused():
    with pytest.raises(ConfigError, match="CheckpointIO plugin .TorchCheckpointIO. would never be used"):
        L.Trainer(strategy=ZcoreStrategy(), accelerator="cpu", devices=1, plugins=[TorchCheckpointIO()], logger=False)


def test_a_config_that_disagrees_with_the_strategy_name_is_refused():
    with pytest.raises(ConfigError, match=r"zero_optimization.stage is 2 but ZcoreStrategy\(stage=3\) gives 3"):
        ZcoreStrategy(config={"zero_optimization": {"stage": 2}}, stage=3)


def test_another_lightning_version_is_warned_about_once(monkeypatch, caplog):
    monkeypatch.setattr(L, "__version__", "0.0.test")
    with caplog.at_level(logging.WARNING, logger="zcore"):
        ZcoreStrategy()
        ZcoreStrategy()
    warnings = [r.getMessage() for r in caplog.records if "tested with Lightning" in r.getMessage()]
    assert warnings == [("zcore: ZcoreStrategy is tested with Lightning 2.6.6, this is 0.0.test: it uses some of "
                         "the Trainer's private API, which may have changed")]
