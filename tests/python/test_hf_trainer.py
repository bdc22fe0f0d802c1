"""transformers' Trainer on zcore (zcore.trainer.ZcoreTrainer) at world 2:
train, evaluate, save, resume, against transformers' own Trainer in one
process.

The reference sees the same samples per optimizer step: with a sequential
sampler, Accelerate gives rank r the per-device batches r, r+2, ... so two
ranks accumulating 2 micro-batches see what one process accumulating 4
sees, including the epoch's shorter last accumulation (7 micro-batches per
rank per epoch). Tolerance: both run fp32 AdamW on the same data; they
differ by the order of gradient sums (two ranks' halves) and zcore's fused
Adam against torch's, ~1e-7 relative per step; over 8 steps the losses
agree within 1e-5 relative (measured 2e-7).
"""

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from devices import skip_on_cuda_build_without_driver
from distributed import run_ranks

transformers.logging.set_verbosity_error()
TIMEOUT = 420
WORLD, MICRO, GAS = 2, 2, 2
SAMPLES, EVAL_SAMPLES, LENGTH = 28, 12, 16
EPOCHS = 2  # 4 optimizer steps each (3 of 2 micro-batches, 1 of 1)


def model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (n, LENGTH), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(output_dir, per_device, gas, **extra):
    settings = dict(
        output_dir=str(output_dir), per_device_train_batch_size=per_device, per_device_eval_batch_size=2,
        gradient_accumulation_steps=gas, num_train_epochs=EPOCHS, learning_rate=5e-3, weight_decay=0.1,
        warmup_steps=2, lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1,
        eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=2, seed=0,
        train_sampling_strategy="sequential", report_to="none", use_cpu=True, disable_tqdm=True,
        remove_unused_columns=False, dataloader_num_workers=0,
    )
    return transformers.TrainingArguments(**{**settings, **extra})


def history(state):
    losses = {e["step"]: e["loss"] for e in state.log_history if "loss" in e}
    evals = {e["step"]: e["eval_loss"] for e in state.log_history if "eval_loss" in e}
    grad_norms = {e["step"]: e["grad_norm"] for e in state.log_history if "grad_norm" in e}
    return losses, evals, grad_norms


def zcore_run(rank, world, output_dir, stage, resume):
    from zcore.trainer import ZcoreTrainer

    trainer = ZcoreTrainer(
        model=model(), args=arguments(output_dir, MICRO, GAS), train_dataset=dataset(SAMPLES, 1),
        eval_dataset=dataset(EVAL_SAMPLES, 2),
        zcore_config={"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
    )
    trainer.train(resume_from_checkpoint=resume)
    final = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(output_dir / "final"))
    return history(trainer.state), final, trainer.engine.full_state_dict()


def reference_run(output_dir):
    trainer = transformers.Trainer(
        model=model(), args=arguments(output_dir, MICRO, GAS * WORLD), train_dataset=dataset(SAMPLES, 1),
        eval_dataset=dataset(EVAL_SAMPLES, 2),
    )
    trainer.train()
    return history(trainer.state), trainer.evaluate()["eval_loss"], trainer.model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"))


def assert_close(got, expected, what):
    assert got.keys() == expected.keys(), what
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-7), (what, step)


@pytest.mark.parametrize("stage", [1, 3])
def test_trainer_trains_evaluates_saves_and_resumes_as_transformers_trainer(tmp_path, reference, stage):
    (ref_losses, ref_evals, ref_norms), ref_final, ref_model = reference
    assert len(ref_losses) == EPOCHS * 4
    results = run_ranks(zcore_run, WORLD, tmp_path / "run", stage, None, timeout=TIMEOUT)
    (losses, evals, norms), final, weights = results[0]
    assert_close(losses, ref_losses, "training loss")
    assert_close(evals, ref_evals, "eval loss")
    assert_close(norms, ref_norms, "gradient norm")
    assert final == pytest.approx(ref_final, rel=1e-5)

    # The final directory loads with from_pretrained, as the engine's weights.
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "final")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, weights[key]), key
    # Adam moves a weight whose gradient is near zero by up to the learning
    # rate whatever the gradient's rounding: compared absolutely (measured
    # 5.4e-6 at stage 3).
    for key, value in ref_model.state_dict().items():
        assert (value - weights[key]).abs().max().item() < 5e-5, key

    # Resumed from the step-2 checkpoint (inside the first epoch: the Trainer
    # skips the batches already seen), steps 3-8 are the uninterrupted run's.
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    resumed = run_ranks(zcore_run, WORLD, tmp_path / "resumed", stage, str(checkpoint), timeout=TIMEOUT)
    (resumed_losses, resumed_evals, _), resumed_final, resumed_weights = resumed[0]
    after = {s: v for s, v in resumed_losses.items() if s > 2}  # the history before comes from the checkpoint
    assert_close(after, {s: v for s, v in losses.items() if s > 2}, "training loss after resuming")
    assert resumed_final == pytest.approx(final, rel=1e-6)
    for key, value in weights.items():
        assert torch.allclose(resumed_weights[key], value, rtol=1e-6, atol=1e-8), key


def refused(rank, world, kind):
    from zcore.errors import ConfigError
    from zcore.trainer import ZcoreTrainer

    extra = {"fp16": True} if kind == "fp16" else {"optim": "sgd"} if kind == "optim" else {}
    config = {"train_micro_batch_size_per_gpu": 8} if kind == "batch" else {}
    try:
        ZcoreTrainer(model=model(), args=arguments("unused", MICRO, GAS, **extra),
                     train_dataset=dataset(SAMPLES, 1), eval_dataset=dataset(EVAL_SAMPLES, 2), zcore_config=config)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind,expected", [
    ("fp16", "set fp16 in the zcore config"),
    ("optim", "TrainingArguments.optim 'sgd'"),
    ("batch", "train_micro_batch_size_per_gpu is 8 but the TrainingArguments give 2"),
])
def test_settings_zcore_cannot_honour_are_refused_with_the_fix(kind, expected):
    message = run_ranks(refused, 1, kind, timeout=TIMEOUT)[0]
    assert message is not None and expected in message


def built_from_auto(rank, world):
    from zcore.trainer import ZcoreTrainer

    config = {  # as DeepSpeed configs written for transformers say it
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
    }
    trainer = ZcoreTrainer(model=model(), args=arguments("unused", MICRO, GAS, bf16=True),
                           train_dataset=dataset(SAMPLES, 1), eval_dataset=dataset(EVAL_SAMPLES, 2),
                           zcore_config=config)
    c = trainer.engine.config
    groups = trainer.engine.optimizer.param_groups
    return (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, c.gradient_clipping,
            c.bf16.enabled, [(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in groups])


def test_auto_values_come_from_the_training_arguments():
    micro, gas, clipping, bf16, groups = run_ranks(built_from_auto, 1, timeout=TIMEOUT)[0]
    assert (micro, gas, clipping, bf16) == (MICRO, GAS, 1.0, True)
    # transformers' split: decay on weights, none on biases and norms.
    assert groups == [(5e-3, 0.1, (0.9, 0.999)), (5e-3, 0.0, (0.9, 0.999))]


def deepspeed_schedule_and_16bit_save(rank, world, output_dir):
    from zcore.trainer import ZcoreTrainer

    config = {  # a DeepSpeed template's schedule and save settings, as transformers resolves them
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto", "warmup_type": "linear"}},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": True},
    }
    args = arguments(output_dir, MICRO, 1, max_steps=6, warmup_steps=3, bf16=True, eval_strategy="no",
                     save_strategy="no")
    trainer = ZcoreTrainer(model=model(), args=args, train_dataset=dataset(SAMPLES, 1), zcore_config=config)
    trainer.train()
    trainer.save_model(str(output_dir / "final"))
    zero = trainer.engine.config.zero_optimization
    lrs = {e["step"]: e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e}
    buckets = (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold)
    return lrs, buckets, trainer.engine.full_state_dict()


def test_a_deepspeed_scheduler_section_with_auto_runs_as_deepspeed_schedules_it(tmp_path):
    lrs, buckets, weights = run_ranks(deepspeed_schedule_and_16bit_save, 1, tmp_path, timeout=TIMEOUT)[0]
    # DeepSpeed's WarmupDecayLR, filled in as transformers fills it (warm-up
    # max(1, warmup_steps) = 3 steps to the learning rate, decay to 0 at
    # max_steps = 6). Optimizer step k runs at the schedule's iteration k - 2
    # (it starts at -1, warmup_min_lr), and the Trainer logs that lr.
    peak = 5e-3

    def warmup_decay(iteration):
        return 0.0 if iteration < 0 else peak * iteration / 3 if iteration < 3 else peak * (6 - iteration) / 3

    expected = {k: warmup_decay(k - 2) for k in range(1, 7)}
    assert lrs.keys() == expected.keys(), lrs
    for step, lr in expected.items():
        assert lrs[step] == pytest.approx(lr, rel=1e-12, abs=1e-15), (step, lrs)
    assert buckets == (32 * 32, int(0.9 * 32 * 32), 320)  # from n_embd = 32
    # stage3_gather_16bit_weights_on_model_save: the weights saved in bf16.
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "final", torch_dtype="auto")
    for key, value in loaded.state_dict().items():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(value, weights[key].to(torch.bfloat16)), key


def skipped_fp16_steps(rank, world):
    from zcore.trainer import ZcoreTrainer

    # A loss scale of 2^22 overflows fp16 gradients until it has come down.
    config = {"fp16": {"enabled": True, "initial_scale_power": 22, "hysteresis": 1},
              "zero_optimization": {"stage": 2}}
    args = arguments("unused", MICRO, 1, max_steps=8, eval_strategy="no", save_strategy="no")
    trainer = ZcoreTrainer(model=model(), args=args, train_dataset=dataset(SAMPLES, 1), zcore_config=config)
    trainer.train()
    return trainer.state.global_step, trainer.engine.skipped_steps, trainer.lr_scheduler.last_epoch


def test_a_step_zcore_skips_does_not_advance_the_schedule():
    """As the Trainer does with Accelerate's gradient scaler."""
    steps, skipped, scheduled = run_ranks(skipped_fp16_steps, 1, timeout=TIMEOUT)[0]
    assert steps == 8 and 0 < skipped < steps
    assert scheduled == steps - skipped


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "hugging-face.md"


def guide_snippet():
    """The guide's ZcoreTrainer block, as written."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    (snippet,) = [b for b in blocks if "ZcoreTrainer(" in b]
    return snippet


def run_guide_snippet(rank, world, output_dir):
    """The guide's block with its names bound: a model, data, and
    TrainingArguments whose ``...`` this test fills in (the block's own
    keywords are passed as written)."""
    def training_arguments(elided, **written):
        assert elided is Ellipsis
        return transformers.TrainingArguments(
            output_dir=str(output_dir), per_device_train_batch_size=MICRO, max_steps=3, logging_steps=1,
            report_to="none", disable_tqdm=True, save_strategy="no", **written)

    names = {"TrainingArguments": training_arguments, "torch": torch, "model": model(),
             "train": dataset(SAMPLES, 1), "test": dataset(EVAL_SAMPLES, 2)}
    exec(guide_snippet(), names)
    trainer = names["trainer"]
    losses, _, _ = history(trainer.state)
    return trainer.args.world_size, trainer.engine.world_size, trainer.state.global_step, losses


def test_the_guide_trainer_snippet_runs_as_written_at_world_2(tmp_path):
    """Regression: without use_cpu=True on a machine without a GPU,
    Accelerate counted one process, the batch size was derived from that
    and the error blamed train_batch_size; the guide now says use_cpu."""
    results = run_ranks(run_guide_snippet, WORLD, tmp_path, timeout=TIMEOUT)
    for args_world, engine_world, steps, losses in results:
        assert (args_world, engine_world, steps) == (WORLD, WORLD, 3)
        assert sorted(losses) == [1, 2, 3] and all(loss > 0 for loss in losses.values())


def without_use_cpu(rank, world, output_dir):
    from zcore.errors import ConfigError
    from zcore.trainer import ZcoreTrainer

    args = arguments(output_dir, MICRO, GAS, use_cpu=False)
    try:
        ZcoreTrainer(model=model(), args=args, train_dataset=dataset(SAMPLES, 1),
                     eval_dataset=dataset(EVAL_SAMPLES, 2), zcore_config={})
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Accelerate runs the ranks without use_cpu")
def test_trainer_and_process_group_seeing_different_worlds_is_refused_with_both_and_the_fix(tmp_path):
    """On a machine without a GPU and without use_cpu=True, Accelerate
    counts one process while torchrun started two (and Accelerate itself
    joined them in a process group)."""
    for message in run_ranks(without_use_cpu, WORLD, tmp_path, timeout=TIMEOUT):
        assert message is not None
        assert "the TrainingArguments see 1 process (Accelerate's distributed type NO, use_cpu=False)" in message
        assert "the process group zcore trains on (torch.distributed) has 2" in message
        assert "pass TrainingArguments(use_cpu=True)" in message
        assert "train_batch_size" not in message


def use_cpu_where_cuda_is_available(rank, world, output_dir):
    torch.cuda.is_available = lambda: True  # as on a GPU machine; nothing here touches the GPU
    from zcore.trainer import ZcoreTrainer

    args = arguments(output_dir, MICRO, 1, max_steps=2, eval_strategy="no", save_strategy="no")
    trainer = ZcoreTrainer(model=model(), args=args, train_dataset=dataset(SAMPLES, 1))
    trainer.train()
    return args.device.type, trainer.engine.device.type, torch.distributed.get_backend(), trainer.state.global_step


@skip_on_cuda_build_without_driver
def test_use_cpu_on_a_gpu_machine_without_a_launcher_trains_on_the_cpu(tmp_path):
    """Regression: Accelerate set up no process group (one process), and
    zcore created an NCCL one, training on the GPU while the Trainer put
    batches on the CPU."""
    result = run_ranks(use_cpu_where_cuda_is_available, 1, tmp_path, launcher=False, timeout=TIMEOUT)[0]
    assert result == ("cpu", "cpu", "gloo", 2)
