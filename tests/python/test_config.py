"""The config: DeepSpeed's keys and rules, and errors that name the key."""

import json
import os

import pytest

import zcore
from zcore.config import load_config, resolve_batch_sizes


def test_deepspeed_config_file_loads(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 32,
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 1.0,
                "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
                "bf16": {"enabled": True},
                "zero_optimization": {
                    "stage": 2,
                    "overlap_comm": True,
                    "contiguous_gradients": True,
                    "reduce_bucket_size": 5e8,
                    "offload_optimizer": {"device": "cpu", "pin_memory": True},
                    "round_robin_gradients": False,
                },
                "steps_per_print": 100,
                "wall_clock_breakdown": False,
            }
        )
    )
    cfg = load_config(path)
    assert cfg.batch_sizes(world_size=4) == (32, 4, 2)
    assert cfg.optimizer.params.betas == (0.9, 0.95)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.scheduler.params.warmup_max_lr == 0.001  # DeepSpeed's WarmupDecayLR default


@pytest.mark.parametrize(
    ("train", "micro", "gas", "world", "expected"),
    [
        (32, 4, 2, 4, (32, 4, 2)),
        (32, 4, None, 4, (32, 4, 2)),
        (32, None, 2, 4, (32, 4, 2)),
        (None, 4, 2, 4, (32, 4, 2)),
        (32, None, None, 4, (32, 8, 1)),
        (None, 4, None, 4, (16, 4, 1)),
    ],
)
def test_batch_size_triple_is_inferred(train, micro, gas, world, expected):
    assert resolve_batch_sizes(train, micro, gas, world) == expected


@pytest.mark.parametrize(
    ("train", "micro", "gas", "match"),
    [
        (30, 4, 2, "must equal"),
        (30, 4, None, "not a multiple"),
        (30, None, 4, "not a multiple"),
        (None, None, 2, "must give train_batch_size"),
        (0, 4, 1, "positive"),
    ],
)
def test_inconsistent_batch_sizes_are_refused(train, micro, gas, match):
    with pytest.raises(zcore.ConfigError, match=match):
        resolve_batch_sizes(train, micro, gas, 4)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"zero_optimization": {"stgae": 2}}, r"unknown key 'zero_optimization.stgae'; allowed here: .*stage"),
        ({"train_batchsize": 8}, r"unknown key 'train_batchsize'.*train_batch_size"),
        ({"zero_optimization": {"stage": "two"}}, r"zero_optimization.stage"),
        ({"gradient_clipping": -1}, r"gradient_clipping"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable at most one"),
        ({"optimizer": {"type": "Lamb"}}, r"optimizer.type.*'Lamb' is not supported"),
        ({"scheduler": {"type": "OneCycle"}}, r"scheduler.*WarmupLR"),
        ({"scheduler": {"type": "WarmupCosineLR", "params": {}}}, r"scheduler.params.total_num_steps"),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, r"offload_optimizer.device"),
        ({"amp": {"enabled": True}}, r"'amp'.*zcore does not support.*bf16.enabled"),
        ({"activation_checkpointing": {}}, r"'activation_checkpointing'.*does not support"),
        ({"wall_clock_breakdown": True}, r"'wall_clock_breakdown' = True"),
        ({"zero_optimization": {"overlap_comm": False}}, r"'zero_optimization.overlap_comm' = False.*always overlaps"),
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage"),
        ({"zero_optimization": {"stage3_max_live_parameters": -1}}, r"stage3_max_live_parameters"),
        ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, r"offload_param.device = 'cpu' needs zero_optimization.stage = 3"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, r"offload_param.device"),
    ],
)
def test_bad_keys_are_named(config, match):
    with pytest.raises(zcore.ConfigError, match=match):
        load_config({"train_batch_size": 8, **config})


def test_unsupported_keys_at_deepspeed_defaults_are_accepted():
    cfg = load_config({"train_batch_size": 8, "wall_clock_breakdown": False, "prescale_gradients": False})
    assert cfg.train_batch_size == 8


def test_file_errors_name_the_path(tmp_path):
    with pytest.raises(zcore.ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(zcore.ConfigError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(zcore.ConfigError, match="must be a dict"):
        load_config(42)


def test_adam_type_follows_deepspeed_weight_decay_mode():
    adam = load_config({"train_batch_size": 8, "optimizer": {"type": "Adam"}}).optimizer
    assert adam.decoupled_weight_decay  # DeepSpeed's adam_w_mode defaults to True
    l2 = load_config(
        {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}
    ).optimizer
    assert not l2.decoupled_weight_decay


BASE = {"train_batch_size": 8}


def with_key(path: str, value):
    """BASE with `value` at the dotted `path` (sections created as needed)."""
    config = json.loads(json.dumps(BASE))
    *sections, key = path.split(".")
    node = config
    for section in sections:
        node = node.setdefault(section, {})
    node[key] = value
    return config


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("zero_optimization.stage", True),
        ("train_batch_size", "4"),
        ("train_batch_size", True),
        ("train_batch_size", 4.5),
        ("steps_per_print", "10"),
        ("gradient_clipping", "1.0"),
        ("gradient_clipping", float("inf")),
        ("gradient_clipping", float("nan")),
        ("optimizer.params.lr", float("inf")),
        ("optimizer.params.betas", [0.9, "0.99"]),
        ("bf16.enabled", 1),
        ("bf16.enabled", "true"),
        ("zero_optimization.reduce_bucket_size", 2**63),
        ("zero_optimization.stage3_max_live_parameters", 2**64),
        ("zero_optimization.stage3_prefetch_bucket_size", float(2**70)),
    ],
)
def test_values_are_not_coerced(path, value):
    config = with_key(path, value)
    if path.startswith("optimizer.params"):
        config["optimizer"]["type"] = "AdamW"
    with pytest.raises(zcore.ConfigError, match=path.split(".")[-1]):
        load_config(config)


def test_integral_floats_are_the_integers_deepspeed_configs_write():
    cfg = load_config({"train_batch_size": 8.0, "zero_optimization": {"reduce_bucket_size": 5e8, "stage": 3}})
    assert cfg.train_batch_size == 8 and type(cfg.train_batch_size) is int
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"[1, 2]", "holds a JSON list"),
        (b"null", "holds a JSON NoneType"),
        (b'"stage 3"', "holds a JSON str"),
        (b"42", "holds a JSON int"),
        (b'{"train_batch_size": 8,}', "not valid JSON: .*line 1 column"),
        (b'{"train_batch_size": 8, "x": "\xff\xfe"}', "not UTF-8 text"),
    ],
)
def test_config_files_that_are_not_a_json_object_name_the_file(tmp_path, content, expected):
    path = tmp_path / "ds.json"
    path.write_bytes(content)
    with pytest.raises(zcore.ConfigError, match=expected) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_a_directory_fifo_or_missing_file_as_config_names_it(tmp_path):
    with pytest.raises(zcore.ConfigError, match="not a regular file") as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(zcore.ConfigError, match="not a regular file"):
        load_config(fifo)  # used to block in open() until a writer came
    with pytest.raises(zcore.ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.json")


def test_a_huge_config_file_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * (2 << 20) + b"{}")
    with pytest.raises(zcore.ConfigError, match="larger than"):
        load_config(path)
