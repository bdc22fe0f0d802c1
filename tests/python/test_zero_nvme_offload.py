"""ZeRO-Infinity: parameters (stage 3) and optimizer states (stages 1-3) on
NVMe match single-process torch AdamW over 20 steps (loss at every step,
final parameters, 1e-5 relative) at worlds 1 to 3, every rank given the
same ``nvme_path``: each on NVMe, both, mixed with host memory; with
accumulation, clipping and a tight live budget; on the tied GPT and on the
model with a layer called twice, a frozen submodule, a branch and an
external parameter; with sub-groups small enough that units span several
of them. Shards and sub-groups really pass through the swap files (their
bytes are counted), and the files are gone once the engines are destroyed.
World 1 runs on ZCORE_TEST_DEVICE (NCCL on a GPU, where the swap files are
read and written through host staging), against torch's AdamW there."""

import os

import pytest

import devices
import zcore
from distributed import run_ranks
from models import global_batch, loss_of, make_model
from training import (
    ON_DEMAND,
    TIGHT,
    assert_matches,
    assert_variants_match,
    train_reference,
    train_zcore,
    zcore_config,
)

STEPS = 20
TOLERANCE = 1e-5
BATCH = 12
SMALL_SUB_GROUPS = {"sub_group_size": 1000}  # the GPT's units are larger: they span sub-groups
# offload_param.max_in_cpu below a rank's 9.3k-27.8k elements at worlds 1-3,
# above its largest parameter: the first groups stay in host memory.
SPLIT = 6000


def variants(path: str) -> list[tuple]:
    nvme = {"device": "nvme", "nvme_path": path}
    # max_in_cpu 0: every shard on NVMe (by default the first 1e9 elements stay in host memory).
    params_nvme = {"offload_param": {**nvme, "max_in_cpu": 0}}
    params_split = {"offload_param": {**nvme, "max_in_cpu": SPLIT}}
    params_host = {"offload_param": {"device": "cpu"}}
    opt_nvme = {"offload_optimizer": nvme}
    # (label, model, accumulation, clipping, optimizer update, stage, zero_optimization keys)
    return [
        ("params on nvme", "gpt", 1, 0.0, False, 3, {**ON_DEMAND, **params_nvme}),
        ("params split by max_in_cpu", "gpt", 2, 0.05, "nvme", 3, {**TIGHT, **params_split, **opt_nvme}),
        ("optimizer on nvme", "gpt", 1, 0.0, "nvme", 3, {**ON_DEMAND, **opt_nvme}),
        ("both on nvme", "gpt", 1, 0.0, "nvme", 3, {**ON_DEMAND, **params_nvme, **opt_nvme, **SMALL_SUB_GROUPS}),
        ("params nvme, optimizer host", "gpt", 1, 0.0, True, 3, {**ON_DEMAND, **params_nvme}),
        ("params host, optimizer nvme", "gpt", 2, 0.05, "nvme", 3, {**ON_DEMAND, **params_host, **opt_nvme}),
        ("tight, accumulate+clip", "gpt", 2, 0.05, "nvme", 3, {**TIGHT, **params_nvme, **opt_nvme}),
        ("mixed use", "mix", 2, 0.05, "nvme", 3, {**TIGHT, **params_nvme, **opt_nvme, **SMALL_SUB_GROUPS}),
        ("stage 1, optimizer on nvme", "gpt", 2, 0.05, "nvme", 1, {**opt_nvme, **SMALL_SUB_GROUPS}),
        ("stage 2, optimizer on nvme", "mix", 2, 0.05, "nvme", 2, opt_nvme),
    ]


def swap_traffic(engine) -> dict:
    """Bytes that went through each swap file of this rank."""
    # The last step may still be writing behind (zcore.step.background_step).
    engine.optimizer.finish_step()
    out = {}
    store = engine.residency._store if engine.zero_stage == 3 else None
    if store is not None and store._swap is not None:
        out["params"] = store._swap.stats()
    master = engine.optimizer.master
    if hasattr(master, "swap"):
        out["optimizer"] = master.swap.stats()
    traffic = {k: (v.bytes_swapped_in, v.bytes_swapped_out) for k, v in out.items()}
    if store is not None:
        fetcher = engine.residency
        shards = [(fetcher.coordinator.shard_tier(g.index).name, g.shard_numel) for g in fetcher.groups]
        traffic["host elements"] = sum(n for t, n in shards if t == "HOST")
        traffic["offloaded tiers"] = [t for t, _ in shards if t != "DEVICE"]
    return traffic


def run_variants(rank, world, path, device):
    devices.init_process_group(device)
    out = {}
    for label, model, gas, clip, optimizer, stage, keys in variants(path):
        config = zcore_config(stage, gas, clip, offload=optimizer is True, zero=keys, train_batch_size=BATCH)
        out[label] = train_zcore(rank, world, model, config, STEPS, inspect=swap_traffic)
    return out


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.device), 2, 3])
def test_states_on_nvme_match_single_process(world, tmp_path, device):
    path = str(tmp_path)
    results = run_ranks(run_variants, world, path, device, launcher=world > 1, timeout=900)
    table = variants(path)
    tolerance = 3e-5 if world == 3 else TOLERANCE
    assert_variants_match(results, table, world, STEPS, BATCH, TOLERANCE, tolerance, device)
    for rank_results in results:
        for label, _, _, _, optimizer, stage, keys in table:
            traffic = rank_results[label]["inspected"]
            if "offload_param" in keys and keys["offload_param"]["device"] == "nvme":
                read, written = traffic["params"]
                assert read > 0 and written > 0, label
                assert rank_results[label]["gather_stats"].staged_bytes == 0, label
                # As DeepSpeed: the first groups in host memory, up to max_in_cpu elements, then NVMe.
                tiers = traffic["offloaded tiers"]
                kept = tiers.index("NVME")
                assert set(tiers[:kept]) <= {"HOST"} and set(tiers[kept:]) == {"NVME"}, label
                assert traffic["host elements"] <= keys["offload_param"]["max_in_cpu"], label
                assert (kept > 0) == (keys["offload_param"]["max_in_cpu"] > 0), label
            if optimizer == "nvme":
                read, written = traffic["optimizer"]
                assert read > 0 and written > read, label  # the first write, then one per step
    assert os.listdir(path) == []  # every swap file removed by engine.destroy()


def run_bf16(rank, world, path):
    nvme = {"device": "nvme", "nvme_path": path}
    out = {}
    for stage, keys in ((3, {"offload_param": nvme, "offload_optimizer": nvme}), (2, {"offload_optimizer": nvme})):
        config = zcore_config(stage, 2, 0.05, "bf16", zero={**ON_DEMAND, **keys, **SMALL_SUB_GROUPS})
        out[stage] = train_zcore(rank, world, "gpt", config, STEPS)
    return out


def test_bf16_with_states_on_nvme_matches_the_mixed_precision_reference(tmp_path):
    """The tolerances of test_mixed_precision (its docstring says why): the
    fused Adam writes each unit's bf16 shard in the same pass over a sub-group."""
    results = run_ranks(run_bf16, 2, str(tmp_path), launcher=True, timeout=600)
    ref = train_reference("gpt", 0.05, STEPS, 2, 2, "bf16")
    for stage, got in results[0].items():
        assert got["update"] == "SwappedAdamUpdate" and got["skipped_steps"] == 0
        assert_matches(got, ref, 2e-4, f"bf16 stage {stage}", 8 * 2.0**-8)



PIPELINES = [(True, True), (True, False), (False, True), (False, False)]


def train_steps(engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = global_batch("gpt", step, engine.train_batch_size())
        loss = loss_of("gpt", engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def run_fewest_buffers(rank, world, path):
    """Each pipeline setting with the fewest buffers initialize accepts
    (every step streams sub-groups larger than the buffers' alignment
    slack): 4 steps, a checkpoint after 2 that a new engine loads and
    trains on from."""
    out = {}
    ckpt = os.path.join(path, "checkpoints")
    for read, write in PIPELINES:
        nvme = {"device": "nvme", "nvme_path": path, "pipeline_read": read, "pipeline_write": write,
                "buffer_count": 1 + read + write}
        for stage in (2, 3):
            config = zcore_config(stage, 1, 0.0, zero={**ON_DEMAND, "offload_optimizer": nvme, **SMALL_SUB_GROUPS})
            engine, _, _, _ = zcore.initialize(model=make_model("gpt"), config=config)
            losses = train_steps(engine, range(2))
            engine.save_checkpoint(ckpt, tag=f"{stage}-{read}-{write}")
            losses += train_steps(engine, range(2, 4))
            engine.destroy()
            again, _, _, _ = zcore.initialize(model=make_model("gpt"), config=config)
            again.load_checkpoint(ckpt, tag=f"{stage}-{read}-{write}")
            out[f"stage {stage}, read {read}, write {write}"] = (losses, train_steps(again, range(2, 4)))
            again.destroy()
    return out


def test_every_pipeline_setting_trains_and_checkpoints_with_the_fewest_buffers_initialize_accepts(tmp_path):
    results = run_ranks(run_fewest_buffers, 1, str(tmp_path), launcher=False, timeout=600)[0]
    ref = train_reference("gpt", 0.0, 4, 1, 1)["losses"]
    for label, (losses, resumed) in results.items():
        for step, (a, b) in enumerate(zip(losses, ref, strict=True)):
            assert abs(a - b) <= TOLERANCE * abs(b), f"{label}: step {step} loss {a} vs {b}"
        assert resumed == losses[2:], label
