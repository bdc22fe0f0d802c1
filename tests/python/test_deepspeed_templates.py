"""The ZeRO templates frameworks ship (Accelerate, TRL, Axolotl,
LLaMA-Factory, DeepSpeed's and transformers' docs), each handed unchanged to
ZcoreTrainer: it trains a tiny GPT-2 for a few steps at world 2 and
``save_model`` writes a directory ``from_pretrained`` loads with the trained
weights. data/deepspeed_templates/SOURCES.md says where each file comes
from.

The TrainingArguments follow each template as a user's would: its fixed
batch size and accumulation where it sets them (zcore refuses a difference,
as transformers does with DeepSpeed), bf16 where its bf16 is true or
"auto". fp16 stays off in the arguments (zcore's fp16 is its config's).
A template that offloads to NVMe runs as a copy with only ``nvme_path``
changed, to a temporary directory.

All templates run in one 2-rank launch (a launch and its imports cost more
than a template's steps); each template's outcome is then its own test.
"""

import copy
import json
import math
from pathlib import Path

import hjson
import pytest
import torch
import transformers

from distributed import run_ranks

transformers.logging.set_verbosity_error()
TEMPLATES = Path(__file__).resolve().parent / "data" / "deepspeed_templates"
NAMES = sorted(path.name for path in TEMPLATES.glob("*.json"))
# Three steps: a WarmupLR whose params are all "auto" (Accelerate's
# templates) warms up over 2 steps from 0 in log steps, so the first two run
# at a learning rate of 0, as in DeepSpeed.
WORLD, STEPS, LENGTH, VOCAB = 2, 3, 16, 96
# fp16 templates start at a loss scale of 2^16, under which this model's
# fp16 gradients overflow: the first steps are skipped (as in DeepSpeed)
# until the scale has come down, so they run longer to reach an update.
FP16_STEPS = 8
DEFAULT_MICRO, DEFAULT_GAS = 2, 1
TIMEOUT = 1200


def model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def dataset(n):
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def read_template(name):
    """The template as a dict: JSON, or hjson where JSON cannot read it (two
    doc blocks have a missing or trailing comma; DeepSpeed reads them with hjson)."""
    text = (TEMPLATES / name).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return dict(hjson.loads(text))


# Templates whose values zcore cannot honour, and the refusal's words: each
# must be refused at ZcoreTrainer with the reason, never trained otherwise.
REFUSED = {
    # DeepSpeed refuses it too: aio is a top-level section.
    "transformers__zero3_nvme.json": "unknown key 'zero_optimization.aio'",
    # DeepSpeed's AutoTP: zcore takes tensor parallelism from a device mesh.
    "llama_factory__ds_z2_autotp_config.json": "'tensor_parallel' = {'autotp_size': 2} is a DeepSpeed key",
}


def nvme_paths_replaced(config, directory):
    config = copy.deepcopy(config)
    for section in ("offload_param", "offload_optimizer"):
        zero = config.get("zero_optimization")
        offload = zero.get(section) if isinstance(zero, dict) else None  # the legacy form is a bool
        if isinstance(offload, dict) and offload.get("nvme_path") is not None:
            offload["nvme_path"] = str(directory)
    return config


def config_source(name, workdir):
    """What the test hands ZcoreTrainer: the template's own path, or for an
    NVMe template a copy whose nvme_path is a temporary directory."""
    config = read_template(name)
    nvme = workdir / "nvme"
    if nvme_paths_replaced(config, nvme) == config:
        return str(TEMPLATES / name)
    nvme.mkdir(exist_ok=True)
    copy_path = workdir / name
    copy_path.write_text(json.dumps(nvme_paths_replaced(config, nvme)))
    return str(copy_path)


def batch_settings(config):
    """(per-device batch, accumulation) as the template fixes them, else the test's own."""
    config = config or {}
    gas = config.get("gradient_accumulation_steps")
    gas = gas if isinstance(gas, int) else DEFAULT_GAS
    micro = config.get("train_micro_batch_size_per_gpu")
    total = config.get("train_batch_size")
    if not isinstance(micro, int):
        micro = total // (gas * WORLD) if isinstance(total, int) else DEFAULT_MICRO
    return micro, gas


def steps_for(config):
    section = (config or {}).get("fp16", {})
    return FP16_STEPS if isinstance(section, dict) and section.get("enabled") is True else STEPS


def uses_bf16(config):
    section = (config or {}).get("bf16", (config or {}).get("bfloat16", {}))
    return isinstance(section, dict) and section.get("enabled") in (True, "auto")


def train_one(name, workdir):
    from zcore.trainer import ZcoreTrainer

    config = read_template(name)
    micro, gas = batch_settings(config)
    steps = steps_for(config)
    args = transformers.TrainingArguments(
        output_dir=str(workdir), per_device_train_batch_size=micro, gradient_accumulation_steps=gas,
        max_steps=steps, learning_rate=1e-2, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, seed=0, bf16=uses_bf16(config), ddp_timeout=120,
    )
    trainer = ZcoreTrainer(model=model(), args=args, train_dataset=dataset(micro * gas * WORLD * steps),
                           zcore_config=config_source(name, workdir))
    try:
        trainer.train()
        trainer.save_model(str(workdir / "saved"))
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return {"steps": trainer.state.global_step, "skipped": trainer.engine.skipped_steps, "losses": losses,
                "weights": trainer.engine.full_state_dict()}
    finally:
        trainer.engine.destroy()


def train_all(rank, world, root):
    """Every template in turn on this rank; an exception is that template's
    outcome, not the launch's."""
    outcomes = {}
    for name in NAMES:
        workdir = Path(root) / name.removesuffix(".json")
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            outcomes[name] = train_one(name, workdir)
        except Exception as exc:  # noqa: BLE001 - reported by this template's test
            outcomes[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return root, run_ranks(train_all, WORLD, str(root), timeout=TIMEOUT)


def test_there_are_templates_of_every_kind():
    configs = {name: read_template(name) for name in NAMES}
    assert len(NAMES) >= 20
    text = {name: (TEMPLATES / name).read_text() for name in NAMES}
    for stage in (0, 1, 2, 3):
        assert any(f'"stage": {stage}' in t for t in text.values()), stage
    assert any('"nvme"' in t for t in text.values())
    assert any('"offload_param"' in t for t in text.values())
    assert any('"offload_optimizer"' in t for t in text.values())
    assert any(uses_bf16(c) for c in configs.values())
    assert any((c or {}).get("fp16", {}).get("enabled") is True for c in configs.values())
    assert any('"auto"' in t for t in text.values()) and any('"auto"' not in t for t in text.values())


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_template_zcore_cannot_honour_is_refused_with_the_reason(outcomes, name):
    _, by_rank = outcomes
    for rank, results in enumerate(by_rank):
        assert REFUSED[name] in results[name].get("error", ""), (rank, results[name])


@pytest.mark.parametrize("name", [name for name in NAMES if name not in REFUSED])
def test_template_trains_at_world_2_and_saves_a_loadable_model(outcomes, name):
    root, by_rank = outcomes
    for rank, results in enumerate(by_rank):
        assert "error" not in results[name], f"rank {rank}: {results[name]['error']}"
    result = by_rank[0][name]
    steps = steps_for(read_template(name))
    assert result["steps"] == steps and result["skipped"] < steps
    assert len(result["losses"]) == steps and all(math.isfinite(loss) and loss > 0 for loss in result["losses"])

    # The saved directory loads as the engine's weights (its fp32 masters, in
    # the dtype saved: 16-bit where the template gathers 16-bit weights on
    # save, as DeepSpeed does), which training moved.
    saved = root / name.removesuffix(".json") / "saved"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict()
    weights = result["weights"]
    initial = model().state_dict()
    for key, value in loaded.items():
        assert torch.equal(value, weights[key].to(value.dtype)), key
    assert any(not torch.equal(initial[key], weights[key]) for key in initial if key in weights)
