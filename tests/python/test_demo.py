"""The README's main command: `zcore demo` trains with ZeRO-3 on 2 ranks (with
`--nvme PATH`, parameters and optimizer states on NVMe)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest


def test_demo_trains_and_reports_memory():
    zcore_cli = Path(sys.executable).with_name("zcore")
    done = subprocess.run(
        [str(zcore_cli), "demo", "--steps", "25"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "ZeRO-3 on 2 rank(s)" in done.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over 25 steps", done.stdout).groups())
    assert last < first - 1.0, f"the loss did not fall: {first} -> {last}"
    held = [float(v) for v in re.findall(r"rank \d: ([\d.]+) MiB held by zcore", done.stdout)]
    ddp = float(re.search(r"DDP would hold ([\d.]+) MiB", done.stdout).group(1))
    assert len(held) == 2 and all(h < ddp for h in held)


def test_demo_with_states_on_nvme_reports_tiers_and_traffic(tmp_path):
    """`zcore demo --nvme PATH`: parameters and optimizer states in swap
    files under PATH; the report says where the bytes lived and how many
    went through the files, and the files are gone afterwards."""
    zcore_cli = Path(sys.executable).with_name("zcore")
    nvme = tmp_path / "nvme"
    done = subprocess.run(
        [str(zcore_cli), "demo", "--steps", "6", "--nvme", str(nvme)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert f"parameters and optimizer states on NVMe under {nvme}" in out
    assert "parameters on nvme, optimizer states on nvme" in out
    header = next(line for line in out.splitlines() if "device" in line and "nvme" in line and "total" in line)
    assert header.split() == ["device", "host", "nvme", "total"]
    on_nvme = [float(v) for v in re.findall(r"rank \d: [\d.]+ MiB held by zcore \(device [\d.]+, host [\d.]+, "
                                             r"nvme ([\d.]+)\)", out)]
    assert len(on_nvme) == 2 and all(v > 0 for v in on_nvme), out
    traffic = re.findall(
        r"rank \d: parameters ([\d.]+) MiB read \((\d+) shard fetches\), ([\d.]+) MiB written; "
        r"optimizer states ([\d.]+) MiB read, ([\d.]+) MiB written", out)  # fmt: skip
    assert len(traffic) == 2, out
    for row in traffic:
        assert all(float(v) > 0 for v in row), row
    assert f"swap files removed by engine.destroy(): 0 left in {nvme}" in out
    assert list(nvme.iterdir()) == []


@pytest.mark.parametrize("nproc, said", [
    ("0", "0 processes: this starts at least 1"),
    ("-2", "-2 processes: this starts at least 1"),
    ("two", "'two' is not a whole number of processes"),
    (str(10**6), f"{10**6} processes: this machine runs at most"),
])
def test_demo_refuses_a_process_count_before_torchs_launcher(monkeypatch, capsys, nproc: str, said: str):
    """Checked before anything starts: torch's launcher ends in a bare
    AssertionError on 0, and a count past the machine's GPUs or CPUs
    starts ranks that cannot run."""
    from zcore import cli

    def launched(*args, **kwargs):
        raise AssertionError(f"the launcher was started: {args}")

    monkeypatch.setattr(cli.subprocess, "call", launched)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["demo", "--nproc", nproc])
    assert stopped.value.code == 2
    assert f"argument --nproc: {said}" in capsys.readouterr().err
