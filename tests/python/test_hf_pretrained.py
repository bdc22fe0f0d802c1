"""Hugging Face model directories in and out of a running engine
(zcore.save_pretrained, zcore.load_pretrained): what transformers'
save_pretrained writes loads into every rank's shards, and what zcore
writes loads with from_pretrained; both streamed, which a bound on each
rank's peak memory checks; another model's weights are refused on every rank.
The cases at world 1 run on ZCORE_TEST_DEVICE (NCCL on a GPU).
"""

import json
import os

import pytest
import torch
import transformers

import devices
import zcore
from distributed import run_ranks
from zcore.errors import CheckpointError

transformers.logging.set_verbosity_error()
TIMEOUT = 300


def gpt2(seed, n_embd=32):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=n_embd, vocab_size=96, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def config_for(world, stage, offload=None, nvme=None):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme)}
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
    elif offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_batch_size": 2 * world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zero}


def batch():
    torch.manual_seed(1234)
    ids = torch.randint(0, 96, (2, 16))
    return ids


# Relative gap between the engine's loss and the source model's, on the same
# device: on a GPU the engine's parameters (views into gathered buffers) may
# get other matmul kernels than the model's own tensors.
LOSS_GAP = {"cpu": 1e-6, "cuda": 1e-5}


def load_transformers_directory(rank, world, directory, stage, offload, nvme, device):
    on = devices.init_process_group(device)
    engine, *_ = zcore.initialize(model=gpt2(seed=7), config=config_for(world, stage, offload, nvme))
    devices.assert_on(engine, device)
    missing, unexpected = zcore.load_pretrained(engine, directory)
    weights = engine.full_state_dict()
    engine.eval()
    ids = batch().to(on)
    with torch.no_grad():
        loss = engine(ids, labels=ids).loss.item()
    # Training goes on from the loaded weights.
    engine.train()
    engine.backward(engine(ids, labels=ids).loss)
    engine.step()
    return missing, unexpected, weights, loss


@pytest.mark.parametrize(
    "stage,offload,shard_size,world",
    [(3, None, "20KB", 2), (3, None, None, 2), (3, "nvme", "20KB", 2), (2, "cpu", "20KB", 2), (0, None, None, 2),
     pytest.param(3, None, "20KB", 1, marks=pytest.mark.device)],
)
def test_a_directory_from_save_pretrained_loads_into_every_ranks_shards(
    tmp_path, stage, offload, shard_size, world, device
):
    source = gpt2(seed=3).eval()
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    source.save_pretrained(tmp_path / "hf", **kwargs)
    sharded = (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert sharded == (shard_size is not None)
    expected = {k: v.clone() for k, v in source.state_dict().items()}
    with torch.no_grad():
        ids = batch().to(device)
        expected_loss = source.to(device)(ids, labels=ids).loss.item()
    (tmp_path / "nvme").mkdir()
    results = run_ranks(load_transformers_directory, world, tmp_path / "hf", stage, offload, tmp_path / "nvme",
                        device, launcher=world > 1, timeout=TIMEOUT)
    for missing, unexpected, _, loss in results:
        assert (missing, unexpected) == ([], [])
        assert loss == pytest.approx(expected_loss, rel=LOSS_GAP[device])
    weights = results[0][2]
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key


def save_and_reload(rank, world, directory, stage, offload, nvme, shard_size, device):
    on = devices.init_process_group(device)
    engine, *_ = zcore.initialize(model=gpt2(seed=5), config=config_for(world, stage, offload, nvme))
    devices.assert_on(engine, device)
    ids = batch().to(on)
    for _ in range(2):
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
    written = zcore.save_pretrained(engine, directory, max_shard_size=shard_size)
    weights = engine.full_state_dict()
    return None if written is None else [p.name for p in written], weights


@pytest.mark.parametrize(
    "stage,offload,shard_size,world",
    [(3, None, "30KB", 2), (3, "nvme", 10**9, 2), (1, None, 30_000, 2),
     pytest.param(3, "nvme", "30KB", 1, marks=pytest.mark.device)],
)
def test_a_directory_saved_from_an_engine_loads_with_from_pretrained(
    tmp_path, stage, offload, shard_size, world, device
):
    (tmp_path / "nvme").mkdir()
    out = tmp_path / "saved"
    # A stale file of an earlier save with another split is removed.
    out.mkdir()
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    results = run_ranks(save_and_reload, world, out, stage, offload, tmp_path / "nvme", shard_size, device,
                        launcher=world > 1, timeout=TIMEOUT)
    names, weights = results[0]
    assert all(written is None for written, _ in results[1:])  # rank 0 writes
    assert "config.json" in names
    assert not (out / "model-00009-of-00009.safetensors").exists()
    if shard_size != 10**9:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    state = loaded.state_dict()
    assert state.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(state[key], value), key
    # Tied weights are written once, as transformers writes them.
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def load_expecting_failure(rank, world, directory, strict):
    engine, *_ = zcore.initialize(model=gpt2(seed=7), config=config_for(world, 3))
    before = engine.full_state_dict()
    try:
        result = zcore.load_pretrained(engine, directory, strict=strict)
    except CheckpointError as exc:
        return type(exc).__name__, str(exc), before, engine.full_state_dict()
    return result, None, before, engine.full_state_dict()


def test_weights_of_another_model_are_refused_on_every_rank_and_change_nothing(tmp_path):
    gpt2(seed=3, n_embd=64).save_pretrained(tmp_path / "wide")
    for kind, message, before, after in run_ranks(load_expecting_failure, 2, tmp_path / "wide", True,
                                                  timeout=TIMEOUT):
        assert kind == "CheckpointMismatchError"
        assert "with another shape" in message and "transformer.wte.weight" in message
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_missing_tensors_are_an_error_unless_not_strict(tmp_path):
    source = gpt2(seed=3)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("transformer.h.1.")}
    source.save_pretrained(tmp_path / "partial", state_dict=dict(state))  # it empties the dict it gets
    results = run_ranks(load_expecting_failure, 2, tmp_path / "partial", True, timeout=TIMEOUT)
    assert results[0][0] == "CheckpointMismatchError"
    assert "missing from the files" in results[0][1] and "strict=False" in results[0][1]
    results = run_ranks(load_expecting_failure, 2, tmp_path / "partial", False, timeout=TIMEOUT)
    (missing, unexpected), _, before, after = results[0]
    assert missing and all(name.startswith("transformer.h.1.") for name in missing) and unexpected == []
    for key in after:
        expected = before[key] if key.startswith("transformer.h.1.") else state[key]
        assert torch.equal(after[key], expected), key


class GPT2IgnoringBlock1(transformers.GPT2LMHeadModel):
    _keys_to_ignore_on_load_missing = [r"transformer\.h\.1\."]


def load_ignoring_block_1(rank, world, directory):
    torch.manual_seed(7)
    model = GPT2IgnoringBlock1(gpt2(seed=7).config)
    engine, *_ = zcore.initialize(model=model, config=config_for(world, 3))
    before = engine.full_state_dict()
    result = zcore.load_pretrained(engine, directory, strict=True)
    return result, before, engine.full_state_dict()


def test_tensors_the_model_ignores_when_missing_keep_their_values(tmp_path):
    source = gpt2(seed=3)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("transformer.h.1.")}
    source.save_pretrained(tmp_path / "partial", state_dict=dict(state))
    (missing, unexpected), before, after = run_ranks(load_ignoring_block_1, 2, tmp_path / "partial",
                                                     timeout=TIMEOUT)[0]
    assert (missing, unexpected) == ([], [])
    for key in after:
        expected = before[key] if key.startswith("transformer.h.1.") else state[key]
        assert torch.equal(after[key], expected), key


def test_a_base_models_weights_load_into_the_model_with_a_head(tmp_path):
    """transformers' rule: keys without the base_model_prefix ('transformer.')."""
    base = transformers.GPT2Model(gpt2(seed=3).config)
    base.save_pretrained(tmp_path / "base")
    (missing, unexpected), message, _, after = run_ranks(load_expecting_failure, 2, tmp_path / "base", True,
                                                          timeout=TIMEOUT)[0]
    assert message is None and (missing, unexpected) == ([], [])
    for key, value in base.state_dict().items():
        assert torch.equal(after[f"transformer.{key}"], value), key


def _safetensors_file(path, header, data=b""):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("case,expected", [
    ("index not json", "is not a safetensors index"),
    ("index with a path", "safetensors file names in the same directory"),
    ("unreadable dtype", "as F8_E4M3, a dtype zcore cannot read"),
    ("header not an object", "has an unreadable header"),
])
def test_bad_files_are_refused_by_name(tmp_path, case, expected):
    directory = tmp_path / "bad"
    directory.mkdir()
    if case == "index not json":
        (directory / "model.safetensors.index.json").write_text("{not json")
    elif case == "index with a path":
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"transformer.wte.weight": "../model.safetensors"}}))
    elif case == "unreadable dtype":
        _safetensors_file(directory / "model.safetensors",
                          {"transformer.wte.weight": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}},
                          b"\0")
    else:
        _safetensors_file(directory / "model.safetensors", [1, 2])
    kind, message, *_ = run_ranks(load_expecting_failure, 1, directory, True, timeout=TIMEOUT)[0]
    assert kind in ("CheckpointError", "CheckpointCorruptError") and expected in message, message


def save_fails_on_one_rank(rank, world, out, nvme):
    path = nvme / f"rank{rank}"
    path.mkdir()
    engine, *_ = zcore.initialize(model=gpt2(seed=5), config=config_for(world, 3, "nvme", path))
    zcore.save_pretrained(engine, out, max_shard_size="30KB")
    first = engine.full_state_dict()
    engine.backward(engine(batch(), labels=batch()).loss)
    engine.step()
    engine.full_state_dict()  # the step behind the forward is done
    if rank == 1:  # this rank's optimizer states vanish: it cannot give its shards
        (lost,) = [p for p in path.rglob("*") if p.is_file() and "-optimizer-" in p.name]
        lost.unlink()
    try:
        zcore.save_pretrained(engine, out, max_shard_size="30KB")
    except zcore.ZcoreError as exc:
        return first, type(exc).__name__, str(exc)
    return first, None, None


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_keeps_the_earlier_save(tmp_path):
    (tmp_path / "nvme").mkdir()
    out = tmp_path / "saved"
    results = run_ranks(save_fails_on_one_rank, 2, out, tmp_path / "nvme", timeout=TIMEOUT)
    for rank, (_, kind, message) in enumerate(results):
        assert kind is not None, f"rank {rank} saw no failure"
        assert "rank 1" in message or rank == 1, message
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # nothing staged is left
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
    first = results[0][0]
    for key, value in first.items():
        assert torch.equal(loaded[key], value), key


def test_not_a_model_directory_names_the_files_it_needs(tmp_path):
    kind, message, *_ = run_ranks(load_expecting_failure, 1, tmp_path, True, timeout=TIMEOUT)[0]
    assert kind == "CheckpointError"
    assert "neither model.safetensors nor model.safetensors.index.json" in message


# Streaming: a GPT-2 of 8 wide layers, so that one tensor (an MLP matrix,
# 4 MiB) is a small part of the whole (~97 MiB in fp32). Peak memory is
# measured as the growth of the process's resident peak (VmHWM, reset
# through /proc/self/clear_refs) across the call.
WIDTH = 512
TENSOR_BYTES = WIDTH * 4 * WIDTH * 4  # the MLP's c_fc and c_proj


def wide_gpt2(seed):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=8, n_head=8, n_embd=WIDTH, vocab_size=96, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def model_bytes():
    return sum(t.numel() * 4 for t in wide_gpt2(0).state_dict().values())


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def peak_growth(call):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from the current resident size
    before = _status("VmRSS:")
    call()
    return _status("VmHWM:") - before


def stream_wide(rank, world, directory):
    config = {"train_batch_size": world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zcore.initialize(model=wide_gpt2(seed=0), config=config)
    # The first save grows the process once by a fixed amount (gloo's
    # gather buffers, the allocator's heap: measured ~42 MB on rank 0, the
    # same with 3x the layers), so the bound applies from the second save.
    zcore.save_pretrained(engine, directory / "out", max_shard_size=3 * TENSOR_BYTES)
    save = peak_growth(lambda: zcore.save_pretrained(engine, directory / "out", max_shard_size=3 * TENSOR_BYTES))
    load = peak_growth(lambda: zcore.load_pretrained(engine, directory / "in"))
    return save, load, engine.full_state_dict()


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_save_and_load_stream_a_tensor_at_a_time(tmp_path):
    world = 4
    source = wide_gpt2(seed=1)
    source.save_pretrained(tmp_path / "in", max_shard_size="20MB")
    assert (tmp_path / "in" / "model.safetensors.index.json").exists()
    whole = model_bytes()
    results = run_ranks(stream_wide, world, tmp_path, timeout=TIMEOUT)
    for rank, (save, load, _) in enumerate(results):
        # Loading stages this rank's ranges (a quarter of the model) plus
        # reads of at most one tensor's range; a whole copy would be ~97 MiB.
        assert load < whole / world + 2 * TENSOR_BYTES + 8 * 2**20, (rank, load, whole)
        # Saving holds one gathered group and its copy on rank 0.
        assert save < 3 * TENSOR_BYTES + 8 * 2**20, (rank, save)
    weights = results[0][2]
    for key, value in source.state_dict().items():
        assert torch.equal(weights[key], value), key
    # Saved before the load: the engine's initial weights.
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").state_dict()
    for key, value in wide_gpt2(seed=0).state_dict().items():
        assert torch.equal(saved[key], value), key


# Checkpoints transformers writes in an older layout than its model computes
# in (zcore.checkpoint.hf_names): Mixtral's experts one tensor per expert
# (the model stacks them), a ViT's attention under its former names.
def mixtral(seed):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=32,
    )
    return transformers.MixtralForCausalLM(config)


def vit(seed):
    torch.manual_seed(seed)
    config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                                    image_size=8, patch_size=4)
    return transformers.ViTModel(config)


def dinov2_swiglu(seed):
    """A fused weight and its fused bias, each split in two by its own
    conversion and read in turn (gate weight, gate bias, up weight, up bias)."""
    torch.manual_seed(seed)
    config = transformers.Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=24, image_size=8, patch_size=4, use_swiglu_ffn=True)
    return transformers.Dinov2Model(config)


def molmo2(seed):
    """A conversion that splits a fused projection to the model's own
    parameter shapes (placeholders at stage 3)."""
    torch.manual_seed(seed)
    config = transformers.Molmo2TextConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                           max_position_embeddings=32, head_dim=8)
    return transformers.Molmo2TextModel(config)


CONVERTED = {"mixtral": mixtral, "vit": vit, "dinov2": dinov2_swiglu, "molmo2": molmo2}


def load_converted(rank, world, directories, stage):
    out = {}
    for kind, directory in directories.items():
        engine, *_ = zcore.initialize(model=CONVERTED[kind](seed=7), config=config_for(world, stage))
        out[kind] = (zcore.load_pretrained(engine, directory), engine.full_state_dict())
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_in_transformers_older_layout_loads_as_from_pretrained_converts_it(tmp_path, stage):
    directories = {}
    for kind, make in CONVERTED.items():
        make(seed=0).save_pretrained(tmp_path / kind)
        directories[kind] = str(tmp_path / kind)
    from safetensors import safe_open
    with safe_open(tmp_path / "mixtral" / "model.safetensors", "pt") as f:  # the layout this test is about
        assert "model.layers.0.block_sparse_moe.experts.2.w1.weight" in f.keys()
    with safe_open(tmp_path / "vit" / "model.safetensors", "pt") as f:
        assert "encoder.layer.0.attention.attention.query.weight" in f.keys()
    (got, _) = run_ranks(load_converted, 2, directories, stage, timeout=TIMEOUT)
    for kind, make in CONVERTED.items():
        (missing, unexpected), weights = got[kind]
        assert (missing, unexpected) == ([], []), kind
        expected = type(make(seed=1)).from_pretrained(directories[kind]).state_dict()
        assert sorted(weights) == sorted(expected), kind
        for name, value in expected.items():
            assert torch.equal(weights[name], value), (kind, name)
