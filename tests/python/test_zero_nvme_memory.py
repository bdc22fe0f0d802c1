"""With parameters, gradients and optimizer states on NVMe, a rank's peak
resident memory does not grow with the model: built on the meta device and
trained for 3 steps, a model of 48 layers (50M parameters, 800 MiB of model
states at 16 bytes each) peaks within a few MiB of one of 24, and far below
its states.

What memory holds instead is bounded by the configuration: the sub-groups
in flight (3 x 12 bytes x sub_group_size), the staging of parameter reads
(twice the prefetch bucket's share), the gathered parameters
(stage3_max_live_parameters), one module's parameters while it is built,
and the unit whose gradient is being added. glibc would keep freed blocks
of a few MiB in its heap (its mmap threshold grows with each large free),
which is the allocator's growth, not zcore's: the ranks run with a fixed
MALLOC_MMAP_THRESHOLD_, as docs/guide/offload-and-nvme.md advises for tight memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zcore
from distributed import run_ranks

WIDTH = 1024
SUB_GROUP = 1_000_000  # elements: 3 x 12 MB in flight
LIMITS = {"stage3_prefetch_bucket_size": 2_000_000, "stage3_max_live_parameters": 3_000_000}


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_growth(rank: int, world: int, layers: int, path: str) -> dict:
    """Peak resident bytes above the start, after start-up and after each step."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    nvme = {"device": "nvme", "nvme_path": path}
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme,
                              "sub_group_size": SUB_GROUP, **LIMITS},
    }
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")  # restarts the peak (VmHWM) from the current size
    start = _status("VmRSS:")
    engine, *_ = zcore.initialize(model=model, config=config)
    peaks = [_status("VmHWM:") - start]
    for step in range(3):
        loss = engine(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))).pow(2).mean()
        engine.backward(loss)
        engine.step()
        peaks.append(_status("VmHWM:") - start)
    params = layers * (WIDTH * WIDTH + WIDTH)
    report = engine.memory_report()
    engine.destroy()
    return {"peaks": peaks, "states": 16 * params, "report": report}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_peak_memory_does_not_grow_with_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    small = run_ranks(peak_growth, 1, 24, str(tmp_path), launcher=False, timeout=300, fresh_interpreter=True)[0]
    large = run_ranks(peak_growth, 1, 48, str(tmp_path), launcher=False, timeout=300, fresh_interpreter=True)[0]
    mib = 2**20
    # Nothing of the model stays in memory between steps.
    for tier in ("device", "host"):
        assert large["report"].measured_tiers[tier].total < mib, large["report"]
    # Twice the model: the same peak, within what one more layer's buffers take.
    assert abs(large["peaks"][-1] - small["peaks"][-1]) < 16 * mib, (small["peaks"], large["peaks"])
    # Far below the model states (800 MiB), and steady once the trace is
    # followed (from the second step, shards are read ahead into staging).
    assert large["peaks"][-1] < large["states"] / 3, (large["peaks"], large["states"])
    assert large["peaks"][3] - large["peaks"][2] < 8 * mib, large["peaks"]
