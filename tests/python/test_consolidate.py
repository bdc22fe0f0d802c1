"""Consolidation of a sharded checkpoint: ``zcore consolidate`` and
``engine.full_state_dict()`` give exactly the gathered parameters,
consolidation streams (peak memory near twice the largest tensor), a new
consolidation replaces an earlier one in the same directory whole, and
the command's errors are one line each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import zcore_config


def train_and_save(rank: int, world: int, name: str, stage: int, ckpt: str) -> dict:
    engine, *_ = zcore.initialize(model=make_model(name), config=zcore_config(stage, 1, 1.0))
    for step in range(3):
        x, y = global_batch(name, step, 8)
        part = slice(rank * 8 // world, (rank + 1) * 8 // world)
        engine.backward(loss_of(name, forward(name, engine, x[part], step, rank), y[part]))
        engine.step()
    engine.save_checkpoint(ckpt)
    full = engine.full_state_dict()
    with zcore.GatheredParameters(list(engine.module.parameters())):
        gathered = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {"full": full, "gathered": gathered}


@pytest.mark.parametrize(("name", "stage"), [("gpt", 3), ("mix", 2)])
def test_consolidated_equals_gathered_parameters(name: str, stage: int, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    result = run_ranks(train_and_save, 2, name, stage, str(ckpt))
    full, gathered = result[0]["full"], result[0]["gathered"]
    assert result[1]["full"] == {}  # gathered to rank 0 only
    files = zcore.checkpoint.consolidate(ckpt, tmp_path / "out", progress=False)
    consolidated = load_file(files[0])
    assert consolidated.keys() == gathered.keys() == full.keys()
    for key, value in gathered.items():
        assert torch.equal(consolidated[key], value.float()), key
        assert torch.equal(full[key], value.float()), key
    model = make_model(name)
    model.load_state_dict(consolidated)  # strict: every key of the original model
    if name == "gpt":  # tied: both names carry the same values
        assert torch.equal(consolidated["lm_head.weight"], consolidated["wte.weight"])


def test_bf16_output_split_files_and_the_command(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_ranks(train_and_save, 2, "gpt", 3, str(ckpt))
    reference = load_file(zcore.checkpoint.consolidate(ckpt, tmp_path / "fp32", progress=False)[0])
    done = subprocess.run(
        [sys.executable, "-m", "zcore.cli", "consolidate", str(ckpt), str(tmp_path / "bf16"),
         "--dtype", "bf16", "--max-shard-size", "20KB"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "consolidating" not in done.stderr  # no progress bar: stderr is not a terminal
    listed = [Path(line) for line in done.stdout.split()]
    index = [p for p in listed if p.name == "model.safetensors.index.json"]
    shards = sorted(p for p in listed if p.suffix == ".safetensors")
    assert index and len(shards) > 1
    assert all(p.stat().st_size <= 20_000 + 4096 or len(load_file(p)) == 1 for p in shards)
    merged = {k: v for p in shards for k, v in load_file(p).items()}
    assert merged.keys() == reference.keys()
    for key, value in reference.items():
        assert merged[key].dtype == torch.bfloat16
        assert torch.equal(merged[key], value.to(torch.bfloat16)), key
    # The console script installed beside this interpreter (not whichever `zcore` is on PATH).
    zcore_cli = Path(sys.executable).with_name("zcore")
    help_text = subprocess.run([str(zcore_cli), "consolidate", "--help"], capture_output=True, text=True, timeout=120)
    assert "--max-shard-size" in help_text.stdout


def weights_in(directory: Path) -> dict[str, torch.Tensor]:
    """What a loader reads from a directory: the files the index names, or the one file."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        import json

        files = set(json.loads(index.read_text())["weight_map"].values())
        return {k: v for name in sorted(files) for k, v in load_file(directory / name).items()}
    return load_file(directory / "model.safetensors")


def test_a_new_consolidation_replaces_an_earlier_one_whole(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_ranks(train_and_save, 2, "gpt", 3, str(ckpt))
    out = tmp_path / "out"
    whole = load_file(zcore.checkpoint.consolidate(ckpt, out, progress=False)[0])
    # Split, then whole again, then split in another way: each time only the
    # new files (and the index where split) are left, and they load as whole.
    for size in (20_000, 5 * 2**30, 40_000):
        files = zcore.checkpoint.consolidate(ckpt, out, max_shard_bytes=size, progress=False)
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in files)
        got = weights_in(out)
        assert got.keys() == whole.keys() and all(torch.equal(got[k], v) for k, v in whole.items())


def test_the_commands_errors_are_one_line_and_leave_no_directory(tmp_path: Path) -> None:
    zcore_cli = Path(sys.executable).with_name("zcore")
    for checkpoint, expected in ((tmp_path / "absent", "does not exist"), (tmp_path, "no 'latest' file")):
        out = tmp_path / "out"
        done = subprocess.run(
            [str(zcore_cli), "consolidate", str(checkpoint), str(out)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 1
        assert done.stderr.startswith("zcore consolidate: ") and expected in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and not out.exists()


class ManyParameters(nn.Module):
    """101 tensors, 208 MB: 100 of 2 MB and the largest of 8 MB."""

    def __init__(self) -> None:
        super().__init__()
        self.many = nn.ParameterList([nn.Parameter(torch.full((512, 1024), float(i))) for i in range(100)])
        self.largest = nn.Parameter(torch.ones(2048, 1024))


def save_many(rank: int, world: int, ckpt: str) -> None:
    engine, *_ = zcore.initialize(model=ManyParameters(), config=zcore_config(3, 1, 1.0))
    engine.save_checkpoint(ckpt)


PEAK_SCRIPT = """
import sys
from pathlib import Path
import zcore.checkpoint

def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

try:
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    base = status("VmRSS")
except OSError:
    base = status("VmHWM")
zcore.checkpoint.consolidate(sys.argv[1], sys.argv[2], progress=False)
print(status("VmHWM") - base)
"""


def test_consolidation_streams(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_ranks(save_many, 2, str(ckpt), timeout=300)
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(ckpt), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, check=True,
    )
    growth = int(done.stdout.strip())
    print(f"consolidation peak RSS growth: {growth / 2**20:.1f} MiB")
    largest, total = 8 << 20, 208 << 20
    assert growth <= 2 * largest + (24 << 20), f"peak RSS grew {growth / 2**20:.1f} MiB (model {total >> 20} MiB)"
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert len(out) == 101 and torch.equal(out["many.7"], torch.full((512, 1024), 7.0))


@pytest.mark.parametrize(("name", "stage"), [("gpt", 3), ("mlp", 1)])
def test_deepspeeds_zero_to_fp32_names_read_zcores_checkpoints(name: str, stage: int, tmp_path: Path) -> None:
    """zcore.utils.zero_to_fp32, as deepspeed.utils.zero_to_fp32 (the
    "mlp" model has frozen parameters, which exclude_frozen_parameters drops)."""
    from zcore.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    ckpt = tmp_path / "ckpt"
    gathered = run_ranks(train_and_save, 2, name, stage, str(ckpt))[0]["gathered"]
    state_dict = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert state_dict.keys() == gathered.keys()
    assert all(torch.equal(state_dict[k], v.float()) for k, v in gathered.items())
    frozen = {n for n, p in make_model(name).named_parameters() if not p.requires_grad}
    assert (name == "mlp") == bool(frozen)
    assert get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True).keys() == (
        gathered.keys() - frozen)
    files = convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "out", max_shard_size="1KB")
    assert len(files) > 1 and weights_in(tmp_path / "out").keys() == gathered.keys()
    model = load_state_dict_from_zero_checkpoint(make_model(name), ckpt)
    assert all(torch.equal(model.state_dict()[k], v.float()) for k, v in gathered.items())
    if name == "gpt":  # tied names share one tensor, as in the model's own state dict
        assert state_dict["lm_head.weight"] is state_dict["wte.weight"]
    with pytest.raises(zcore.InvalidArgumentError, match="lazy_mode"):
        get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
