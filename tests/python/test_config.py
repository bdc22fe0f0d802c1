"""The config: DeepSpeed's keys and rules, and errors that name the key."""

import json
import os

import pytest
import torch

import zcore
from zcore.config.schema import load_config, resolve_batch_sizes


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
        ({"zero_optimization": {"stgae": 2}}, r"unknown key 'zero_optimization.stgae'; .* Allowed here: .*stage"),
        ({"zero_optimization": {"stage": "two"}}, r"zero_optimization.stage"),
        ({"gradient_clipping": -1}, r"gradient_clipping"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable at most one"),
        ({"optimizer": {"type": "Lamb"}}, r"optimizer.type.*'Lamb' is not supported"),
        (
            {"scheduler": {"type": "CosineAnnealing"}},
            r"scheduler.*'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR', 'OneCycle' or 'LRRangeTest'",
        ),
        ({"scheduler": {"type": "WarmupCosineLR", "params": {}}}, r"scheduler.params.total_num_steps"),
        ({"zero_optimization": {"offload_optimizer": {"device": "disk"}}}, r"offload_optimizer.device"),
        ({"amp": {"enabled": True}}, r"'amp'.*zcore does not support.*bf16.enabled"),
        ({"wall_clock_breakdown": 2}, r"wall_clock_breakdown: .*not a boolean"),
        ({"tensorboard": {"enabled": True, "log_dir": "x"}}, r"tensorboard.log_dir"),
        ({"flops_profiler": {"profile_step": 0}}, r"flops_profiler.profile_step"),
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage"),
        ({"zero_optimization": {"stage3_max_live_parameters": -1}}, r"stage3_max_live_parameters"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}, r"offload_param.device"),
    ],
)
def test_bad_keys_are_named(config, match):
    with pytest.raises(zcore.ConfigError, match=match):
        load_config({"train_batch_size": 8, **config})


def test_unsupported_keys_at_deepspeed_defaults_are_accepted():
    cfg = load_config({"train_batch_size": 8, "wall_clock_breakdown": False, "prescale_gradients": False})
    assert cfg.train_batch_size == 8


def test_deepspeed_zero3_keys_at_their_defaults_are_accepted():
    """As a DeepSpeed ZeRO-3 config (Hugging Face's examples) writes them."""
    cfg = load_config({
        "train_batch_size": 8,
        "zero_optimization": {
            "stage": 3, "ignore_unused_parameters": True, "stage3_gather_16bit_weights_on_model_save": False,
        },
        "checkpoint": {
            "tag_validation": "warn", "load_universal": False, "use_node_local_storage": False,
            "parallel_write": {"pipeline_stage": False},
        },
        "fp16": {"enabled": False, "auto_cast": False},
        "data_types": {"grad_accum_dtype": "fp32"},  # what zcore does: bf16 configs often say so
        "zero_force_ds_cpu_optimizer": True,
    })
    assert cfg.checkpoint.tag_validation == "warn"


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("checkpoint.tag_validation", "Strict", "'Warn', 'Ignore' or 'Fail'"),
        ("fp16.auto_cast", True, "torch autocast"),
        ("data_types.grad_accum_dtype", "bf16", "accumulates gradients in fp32"),
        ("fp16.fp16_master_weights_and_grads", True, "master weights and gradients in fp32"),
        ("torch_autocast", {"enabled": True, "dtype": "bfloat16"}, "torch autocast inside the engine"),
        ("amp", {"enabled": 1, "opt_level": "O1"}, "bf16.enabled or fp16.enabled"),
        ("hybrid_engine", {"enabled": True}, "hybrid"),
        ("gradient_allreduce_op", "sum", "averages gradients"),
        ("zero_optimization.zero_quantized_nontrainable_weights", "yes", "frozen weights quantized"),
    ],
)
def test_deepspeed_keys_off_their_defaults_are_refused_with_the_reason(path, value, match):
    with pytest.raises(zcore.ConfigError, match=match):
        load_config(with_key(path, value))


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
        ("gradient_clipping", float("inf")),
        ("gradient_clipping", float("nan")),
        ("optimizer.params.lr", float("inf")),
        ("optimizer.params.betas", [0.9, "0.99"]),
        ("zero_optimization.reduce_bucket_size", 2**63),
        ("zero_optimization.stage3_max_live_parameters", 2**64),
        ("zero_optimization.stage3_prefetch_bucket_size", float(2**70)),
        ("zero_optimization.sub_group_size", True),
        ("zero_optimization.offload_optimizer.buffer_count", True),
        ("zero_optimization.offload_param.buffer_size", True),
        ("zero_optimization.offload_param.max_in_cpu", False),
        ("zero_optimization.offload_param.nvme_path", 1),
        ("aio.block_size", True),
    ],
)
def test_values_deepspeed_would_refuse_are_refused(path, value):
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
        (b'{"train_batch_size": 8 "x": 1}', "not valid JSON: .*line 1 column.*nor hjson"),
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


# ZeRO-Infinity (NVMe offload) keys: DeepSpeed's names and defaults.
NVME_DEFAULTS = {
    "zero_optimization": {
        "stage": 3,
        "sub_group_size": 1e9,
        "offload_optimizer": {
            "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": False, "buffer_count": 4,
            "pipeline_read": False, "pipeline_write": False, "fast_init": False, "ratio": 1.0,
        },
        "offload_param": {
            "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": False, "buffer_count": 5,
            "buffer_size": 1e8, "max_in_cpu": 1e9,
        },
    },
    "aio": {
        "block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
        "overlap_events": True, "use_gds": False, "thread_count": 1,
    },
}


def test_nvme_offload_keys_at_deepspeed_defaults_round_trip():
    given = load_config({**BASE, **NVME_DEFAULTS})
    omitted = load_config(BASE)
    for cfg in (given, omitted):
        zero = cfg.zero_optimization
        assert zero.sub_group_size == 1_000_000_000 and type(zero.sub_group_size) is int
        assert (zero.offload_optimizer.buffer_count, zero.offload_optimizer.pin_memory) == (4, False)
        assert not zero.offload_optimizer.fast_init
        param = zero.offload_param
        assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (5, 100_000_000, 1_000_000_000)
        assert cfg.aio.model_dump() == {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1}
    # DeepSpeed's pipeline defaults are false; zcore's are true (config.py says why).
    assert not (given.zero_optimization.offload_optimizer.pipeline_read or
                given.zero_optimization.offload_optimizer.pipeline_write)
    assert omitted.zero_optimization.offload_optimizer.pipeline_read
    assert omitted.zero_optimization.offload_optimizer.pipeline_write
    assert given.zero_optimization.offload_optimizer.device == "nvme"
    assert given.zero_optimization.offload_param.nvme_path == "/local_nvme"
    assert omitted.zero_optimization.offload_param.device == "none"
    assert omitted.zero_optimization.offload_param.nvme_path is None


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
@pytest.mark.parametrize("nvme_path", [{}, {"nvme_path": ""}, {"nvme_path": None}])
def test_nvme_offload_without_a_path_is_refused_naming_the_key(section, nvme_path):
    config = {**BASE, "zero_optimization": {"stage": 3, section: {"device": "nvme", **nvme_path}}}
    with pytest.raises(zcore.ConfigError) as info:
        load_config(config)
    assert (
        f"zero_optimization.{section}.nvme_path is required when zero_optimization.{section}.device "
        "is 'nvme'; set it to a directory on a fast local disk"
    ) in str(info.value)


@pytest.mark.parametrize("device", ["none", "cpu"])
def test_a_path_without_nvme_offload_is_accepted_as_deepspeed_ignores_it(device):
    zero = {"stage": 3, "offload_param": {"device": device, "nvme_path": "/does/not/exist"}}
    cfg = load_config({**BASE, "zero_optimization": zero})
    assert cfg.zero_optimization.offload_param.nvme_path == "/does/not/exist"


@pytest.mark.parametrize("block_size", [1, 512, 1000, 4097, 1048576 + 512])
def test_aio_block_size_must_be_a_multiple_of_4096(block_size):
    with pytest.raises(zcore.ConfigError, match=r"aio.block_size: .*must be a multiple of 4096 bytes"):
        load_config(with_key("aio.block_size", block_size))


@pytest.mark.parametrize("block_size", [4096, 8192, 1048576, 16 << 20, 4096.0])
def test_aio_block_sizes_that_are_multiples_of_4096_are_accepted(block_size):
    assert load_config(with_key("aio.block_size", block_size)).aio.block_size == int(block_size)


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [("block_size", (1 << 30) + 4096, 1 << 30), ("block_size", 1 << 40, 1 << 30),
     ("queue_depth", 1025, 1024), ("intra_op_parallelism", 65, 64)],
)
def test_aio_values_past_what_the_io_engine_takes_are_refused_naming_the_key(key, value, bound):
    with pytest.raises(zcore.ConfigError, match=rf"aio.{key}: .*less than or equal to {bound}"):
        load_config(with_key(f"aio.{key}", value))
    assert getattr(load_config(with_key(f"aio.{key}", bound)).aio, key) == bound


def test_aio_null_is_deepspeeds_defaults():
    assert load_config({**BASE, "aio": None}).aio == load_config(BASE).aio


@pytest.mark.parametrize(
    ("path", "value", "read"),
    [
        ("steps_per_print", "10", 10),
        ("gradient_clipping", "1.0", 1.0),
        ("gradient_clipping", " 5e-1 ", 0.5),
        ("bf16.enabled", 1, True),
        ("bf16.enabled", "true", True),
        ("bf16.enabled", "No", False),
        ("zero_optimization.offload_optimizer.pipeline_read", 1, True),
        ("zero_optimization.offload_optimizer.fast_init", 0.0, False),
        ("aio.queue_depth", "8", 8),
        ("zero_optimization.reduce_bucket_size", "1e9", 1_000_000_000),
        ("zero_optimization.stage", "3", 3),
        ("zero_allow_untested_optimizer", 1, True),
    ],
)
def test_values_are_read_as_deepspeeds_models_read_them(path, value, read):
    parsed = load_config(with_key(path, value))
    for key in path.split("."):
        parsed = getattr(parsed, key)
    assert type(parsed) is type(read) and parsed == read


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("zero_optimization.overlap_comm", False),
        ("zero_optimization.contiguous_gradients", 0),
        ("zero_optimization.round_robin_gradients", True),
        ("zero_optimization.reduce_scatter", False),
        ("zero_optimization.offload_optimizer.ratio", 0.3),
        ("zero_optimization.stage3_model_persistence_threshold", 1e9),
        ("zero_force_ds_cpu_optimizer", False),
        ("aio.use_gds", True),
        ("aio.single_submit", True),
        ("checkpoint.load_universal", True),
        ("activation_checkpointing", {"partition_activations": True, "cpu_checkpointing": True}),
        ("comms_logger", {"enabled": True}),
        ("prescale_gradients", True),
    ],
)
def test_deepspeed_tuning_keys_are_accepted_at_any_value_and_listed_with_what_zcore_does(path, value):
    cfg = load_config(with_key(path, value))
    line = cfg.decided_keys_line()
    assert line is not None and f"{path} (" in line, line
    assert load_config(BASE).decided_keys_line() is None


def test_a_tuning_key_of_the_wrong_type_is_refused_as_deepspeed_refuses_it():
    with pytest.raises(zcore.ConfigError, match="zero_optimization.overlap_comm: not a boolean"):
        load_config(with_key("zero_optimization.overlap_comm", "sometimes"))


@pytest.mark.parametrize(
    ("alias", "key", "value"),
    [
        ("zero_optimization.prefetch_bucket_size", "stage3_prefetch_bucket_size", 12345),
        ("zero_optimization.param_persistence_threshold", "stage3_param_persistence_threshold", 77),
        ("zero_optimization.max_live_parameters", "stage3_max_live_parameters", 1e8),
        ("zero_optimization.max_reuse_distance", "stage3_max_reuse_distance", 0),
        ("zero_optimization.gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
        ("zero_optimization.stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", 1),
    ],
)
def test_deepspeeds_other_names_set_the_same_key(alias, key, value):
    cfg = load_config(with_key(alias, value))
    assert getattr(cfg.zero_optimization, key) == value
    both = with_key(alias, value)
    both["zero_optimization"][key] = value
    assert getattr(load_config(both).zero_optimization, key) == value
    both["zero_optimization"][key] = 3
    with pytest.raises(zcore.ConfigError, match=f"{alias}.*and.*{key}.*name the same setting"):
        load_config(both)


def test_an_aliased_keys_bad_value_is_named_as_written():
    with pytest.raises(zcore.ConfigError, match=r"zero_optimization.prefetch_bucket_size: .*greater than or equal to 0"):
        load_config(with_key("zero_optimization.prefetch_bucket_size", -1))
    with pytest.raises(zcore.ConfigError, match=r"bfloat16.enabled: .*not a boolean"):
        load_config({**BASE, "bfloat16": {"enabled": "maybe"}})


def test_bfloat16_is_deepspeeds_older_name_of_bf16():
    assert load_config({**BASE, "bfloat16": {"enabled": True}}).bf16.enabled


def test_deepspeeds_deprecated_cpu_offload_switches_offload_to_the_cpu():
    cfg = load_config({**BASE, "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": 1}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert load_config(with_key("zero_optimization.cpu_offload", False)).zero_optimization.offload_optimizer.device == "none"
    with pytest.raises(zcore.ConfigError, match="cpu_offload.*and.*offload_optimizer.*both offload"):
        load_config({**BASE, "zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})


def test_sub_group_size_0_lets_zcore_size_the_sub_groups():
    cfg = load_config(with_key("zero_optimization.sub_group_size", 0))
    assert "sub_group_size" not in cfg.zero_optimization.model_fields_set
    assert "sub_group_size = 0" in cfg.decided_keys_line()


@pytest.mark.parametrize("section", ["zero_optimization", "zero_optimization.offload_param", "fp16", "bf16"])
def test_auto_in_deepspeeds_own_sections_is_the_default_as_in_deepspeed(section):
    key = {"zero_optimization": "reduce_bucket_size", "zero_optimization.offload_param": "buffer_size"}.get(
        section, "enabled")
    cfg = load_config(with_key(f"{section}.{key}", "auto"))
    node = cfg
    for part in section.split("."):
        node = getattr(node, part)
    assert key not in node.model_fields_set
    assert f'{section}.{key} = "auto"' in cfg.decided_keys_line()


def test_a_top_level_key_nobody_reads_is_ignored_with_one_warning_naming_it():
    cfg = load_config({**BASE, "comms_config": {"verbose": False}, "gradient_cliping": 1.0})
    line = cfg.ignored_keys_line()
    assert "'comms_config'" in line and "'gradient_cliping' (did you mean 'gradient_clipping'?)" in line
    assert cfg.gradient_clipping == 1.0  # the misspelt key is not read: DeepSpeed's default
    assert load_config(BASE).ignored_keys_line() is None


def test_a_dropped_key_two_sections_deep_leaves_the_callers_config_unchanged():
    config = with_key("zero_optimization.offload_optimizer.ratio", 0.5)
    load_config(config)
    assert config["zero_optimization"]["offload_optimizer"] == {"ratio": 0.5}


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("zero_optimization.sub_group_size", -1),
        ("zero_optimization.offload_optimizer.buffer_count", 0),
        ("zero_optimization.offload_param.buffer_count", 0),
        ("zero_optimization.offload_param.buffer_size", 0),
        ("zero_optimization.offload_param.max_in_cpu", -1),
        ("aio.queue_depth", 0),
        ("aio.intra_op_parallelism", 0),
        ("aio.block_size", 0),
    ],
)
def test_nvme_sizes_and_counts_out_of_range_are_refused_naming_the_key(path, value):
    with pytest.raises(zcore.ConfigError, match=rf"{path}: Input should be greater than"):
        load_config(with_key(path, value))


def test_no_parameter_shards_kept_in_host_memory_is_accepted():
    cfg = load_config(with_key("zero_optimization.offload_param.max_in_cpu", 0))
    assert cfg.zero_optimization.offload_param.max_in_cpu == 0


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("zero_optimization.stgae", "zero_optimization.stage"),
        ("zero_optimization.offload_optimiser", "zero_optimization.offload_optimizer"),
        ("zero_optimization.stage3_prefetch_bucket", "zero_optimization.stage3_prefetch_bucket_size"),
        ("zero_optimization.offload_param.nvme_pth", "zero_optimization.offload_param.nvme_path"),
    ],
)
def test_an_unknown_key_in_a_section_suggests_the_nearest_known_key(typo, meant):
    with pytest.raises(zcore.ConfigError) as info:
        load_config(with_key(typo, 1))
    (line,) = [problem.strip() for problem in str(info.value).splitlines()[1:]]
    assert line.startswith(f"unknown key {typo!r}; did you mean {meant!r}? Allowed here: "), line
    assert meant.rsplit(".", 1)[-1] in line.split("Allowed here: ")[1].split(", "), line


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("gradient_accumulation_step", "gradient_accumulation_steps"),
        ("train_micro_batch_size", "train_micro_batch_size_per_gpu"),
        ("zero_optimisation", "zero_optimization"),
    ],
)
def test_an_unknown_top_level_key_is_ignored_as_deepspeed_does_with_the_nearest_key_named(typo, meant):
    line = load_config(with_key(typo, 1)).ignored_keys_line()
    assert f"{typo!r} (did you mean {meant!r}?)" in line


def test_an_unknown_key_near_no_known_key_lists_the_allowed_keys_only():
    with pytest.raises(zcore.ConfigError) as info:
        load_config(with_key("zero_optimization.colour", 1))
    assert "did you mean" not in str(info.value)
    assert "unknown key 'zero_optimization.colour'; allowed here: allgather_bucket_size, " in str(info.value)


# Keys DeepSpeed configs written for transformers set to "auto".
TRAINER_FILLS = ["gradient_clipping", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                 "optimizer.params.weight_decay", "bf16.enabled", "fp16.enabled",
                 "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
                 "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps"]
# Outside DeepSpeed's own sections, where "auto" is the default.
REFUSED_FILLS = [path for path in TRAINER_FILLS if path.split(".")[0] not in ("bf16", "fp16")]
TRAINER_LEAVES = ["optimizer.params.adam_w_mode", "communication_data_type"]


@pytest.mark.parametrize("path", REFUSED_FILLS + TRAINER_LEAVES)
def test_auto_outside_the_trainer_says_who_resolves_it_and_to_put_a_value(path):
    config = with_key(path, "auto")
    if path.startswith("optimizer."):
        config["optimizer"]["type"] = "AdamW"
    if path.startswith("scheduler."):
        config["scheduler"].update(type="WarmupDecayLR", params={**config["scheduler"]["params"], "total_num_steps": 9}
                                   if path != "scheduler.params.total_num_steps" else config["scheduler"]["params"])
    with pytest.raises(zcore.ConfigError) as info:
        load_config(config)
    (line,) = [problem.strip() for problem in str(info.value).splitlines()[1:]]
    assert line.startswith(f'{path} = "auto": "auto" is resolved only by zcore.trainer.ZcoreTrainer, from its '
                           "TrainingArguments"), line
    assert "put a value there instead" in line and "valid number" not in line
    if path in TRAINER_LEAVES:
        assert "and only at gradient_clipping, optimizer.params.lr" in line
    default = {"optimizer.params.lr": "0.001", "optimizer.params.betas": "[0.9, 0.999]",
               "optimizer.params.adam_w_mode": "true"}.get(path)
    if default is not None:
        assert line.endswith(f"(or remove the key for the default, {default})"), line


def test_auto_still_infers_a_batch_size():
    config = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": 2})
    assert config.batch_sizes(world_size=2) == (16, 4, 2)


def test_the_trainer_resolves_each_key_the_auto_message_says_it_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    from zcore.config.schema import TRAINER_AUTO_KEYS
    from zcore.trainer import _config_from, _scheduler_from

    assert sorted(TRAINER_AUTO_KEYS) == sorted(TRAINER_FILLS)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                          learning_rate=3e-4, max_grad_norm=0.5, adam_beta2=0.95, warmup_steps=7)
    config = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupDecayLR"}}
    for path in TRAINER_AUTO_KEYS:
        *sections, key = path.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = "auto"
    resolved = _config_from(args, config, world_size=1)  # every "auto" filled in, or load_config would refuse it
    assert resolved.optimizer.params.lr == 3e-4 and resolved.optimizer.params.betas == (0.9, 0.95)
    assert resolved.gradient_clipping == 0.5
    assert not resolved.bf16.enabled and not resolved.fp16.enabled
    schedule = _scheduler_from(args, config["scheduler"], num_training_steps=100)
    assert schedule.type == "WarmupDecayLR"
    assert (schedule.params.warmup_min_lr, schedule.params.warmup_max_lr) == (0.0, 3e-4)
    assert (schedule.params.warmup_num_steps, schedule.params.total_num_steps) == (7, 100)


def test_the_trainer_sizes_auto_buckets_from_the_hidden_size_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    from zcore.trainer import _config_from

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=48, n_layer=1, n_head=2, vocab_size=64))
    auto = {"reduce_bucket_size": "auto", "prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto"}
    zero = _config_from(args, {"zero_optimization": {"stage": 3, **auto}}, 1, model).zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size) == (48 * 48, int(0.9 * 48 * 48))
    assert zero.stage3_param_persistence_threshold == 480
    zero = _config_from(args, {"zero_optimization": {"stage": 2, **auto}}, 1, model).zero_optimization
    assert zero.reduce_bucket_size == 48 * 48
    assert "stage3_prefetch_bucket_size" not in zero.model_fields_set  # stage 2: DeepSpeed's default
    with pytest.raises(zcore.ConfigError, match="hidden size.*put a number there"):
        _config_from(args, {"zero_optimization": {"stage": 2, **auto}}, 1, torch.nn.Linear(2, 2))


def test_a_file_json_cannot_read_is_read_as_deepspeed_reads_it_with_hjson(tmp_path):
    """Templates that frameworks ship with a trailing or a missing comma at a
    line's end, and comments: DeepSpeed reads them (hjson), so zcore does."""
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  # ZeRO-2\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2,}\n  "steps_per_print": 5\n}\n')
    cfg = load_config(path)
    assert (cfg.train_batch_size, cfg.zero_optimization.stage, cfg.steps_per_print) == (8, 2, 5)


def test_deepspeeds_oldest_zero_switch_is_read_as_deepspeed_reads_it():
    cfg = load_config({**BASE, "zero_optimization": True, "allgather_size": 2e8})
    assert (cfg.zero_optimization.stage, cfg.zero_optimization.allgather_bucket_size) == (1, 200_000_000)
    assert load_config({**BASE, "zero_optimization": False}).zero_optimization.stage == 0


def test_steps_per_print_infinity_as_accelerate_writes_it_never_prints():
    assert load_config({**BASE, "steps_per_print": float("inf")}).steps_per_print >= 2**62


@pytest.mark.parametrize("key, value, refused", [
    ("adam_w_mode", True, None), ("torch_adam", True, None), ("foreach", False, None),
    ("fp32_optimizer_states", 1, None), ("per_head_muon", "false", None),
    ("adam_w_mode", False, "always decays weights decoupled"),
    ("fp32_optimizer_states", False, "always keeps its states in fp32"),
    ("per_head_muon", True, "orthogonalises each matrix whole"),
])
def test_deepspeeds_muon_keys_are_read_as_deepspeed_reads_them(key, value, refused):
    config = {**BASE, "optimizer": {"type": "Muon", "params": {"lr": 0.02, key: value}}}
    if refused is None:
        load_config(config)
        return
    with pytest.raises(zcore.ConfigError, match=f"optimizer.params.{key}.*{refused}.*remove the key"):
        load_config(config)


@pytest.mark.parametrize("stage", [0, 1, "2"])
def test_parameter_offload_below_stage_3_is_ignored_as_deepspeed_ignores_it(stage):
    """DeepSpeed reads offload_param at stage 3 only (a template whose stage
    was lowered keeps it): the parameters stay on the device, and the
    decided-keys line says so."""
    for device in ("cpu", "nvme"):
        cfg = load_config({"train_batch_size": 8, "zero_optimization": {
            "stage": stage, "offload_param": {"device": device, "nvme_path": "/nvme", "pin_memory": True}}})
        assert cfg.zero_optimization.offload_param.device == "none"
        assert f"offload_param (device '{device}': read at stage 3 only, so ignored at stage {int(stage)}" in (
            cfg.decided_keys_line())
    kept = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert kept.zero_optimization.offload_param.device == "cpu"
