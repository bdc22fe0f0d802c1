"""zcore under torchrun: no launcher of its own, the env:// rendezvous."""

import subprocess
import sys
from pathlib import Path


def test_trains_under_torchrun():
    script = Path(__file__).with_name("torchrun_train.py")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 (gloo): 3 steps" in done.stdout
