"""The README's main command: `zcore demo` trains with ZeRO-3 on 2 ranks."""

import re
import subprocess
import sys
from pathlib import Path


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
