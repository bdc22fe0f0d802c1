"""Progress bars of long operations: drawn when stderr is a terminal, each
ending at 100% (its total is what the operation does), and nothing at all
written when stderr is not a terminal."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import zcore_config


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def last_render(drawn: str, description: str) -> str:
    """The bar's final state: tqdm redraws it in place after a carriage return."""
    renders = [part for line in drawn.splitlines() for part in line.split("\r") if part.startswith(description)]
    assert renders, f"no bar {description!r} in {drawn!r}"
    return renders[-1]


def test_a_bar_is_drawn_on_a_terminal_only() -> None:
    from zcore.progress import progress_bar

    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        with progress_bar("saving checkpoint global_step10", 3 * 2**20, file=stream) as bar:
            bar.update(2**20)
            bar.update(2 * 2**20)
    assert "100%" in last_render(terminal.getvalue(), "saving checkpoint global_step10")
    assert "3.15M/3.15M" in terminal.getvalue()  # bytes, scaled
    assert pipe.getvalue() == ""


def test_no_bar_when_disabled_or_with_nothing_to_do() -> None:
    from zcore.progress import progress_bar

    terminal = Terminal()
    with progress_bar("consolidating checkpoint t", 100, enabled=False, file=terminal) as bar:
        bar.update(100)
    with progress_bar("writing optimizer states to NVMe", 0, file=terminal):
        pass
    assert terminal.getvalue() == ""


def checkpoint_operations(rank: int, world: int, root: str) -> tuple[str, str]:
    """Start-up with parameters and optimizer states on NVMe, a checkpoint
    saved, loaded and consolidated, a Hugging Face directory saved and
    loaded: first with stderr a terminal, then (saving and loading again)
    with stderr a pipe. Returns what each wrote to stderr."""
    import zcore

    root_dir = Path(root)
    (root_dir / "swap").mkdir()
    nvme = {"device": "nvme", "nvme_path": str(root_dir / "swap")}
    cfg = zcore_config(3, 1, 1.0, train_batch_size=4, zero={
        "stage3_param_persistence_threshold": 0, "sub_group_size": 700,
        "offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme,
    })
    terminal, pipe = Terminal(), io.StringIO()
    sys.stderr = terminal
    torch.manual_seed(0)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=cfg)
    x, y = global_batch("gpt", 0, 4)
    engine.backward(loss_of("gpt", forward("gpt", engine, x, 0, rank), y))
    engine.step()
    engine.save_checkpoint(root_dir / "ckpt")
    engine.load_checkpoint(root_dir / "ckpt")
    zcore.checkpoint.consolidate(root_dir / "ckpt", root_dir / "consolidated")
    zcore.save_pretrained(engine, root_dir / "hf")
    zcore.load_pretrained(engine, root_dir / "hf")
    sys.stderr = pipe
    engine.save_checkpoint(root_dir / "ckpt", tag="again")
    engine.load_checkpoint(root_dir / "ckpt", tag="again")
    engine.destroy()
    return terminal.getvalue(), pipe.getvalue()


def test_checkpoint_and_nvme_start_up_bars(tmp_path: Path) -> None:
    (drawn, piped), = run_ranks(checkpoint_operations, 1, str(tmp_path), launcher=False, timeout=300)
    for description in (
        "writing parameters and optimizer states to NVMe",
        "saving checkpoint global_step1",
        "loading checkpoint global_step1",
        "consolidating checkpoint global_step1",
        "saving weights to hf",
        "loading weights from hf",
    ):
        assert "100%" in last_render(drawn, description), description
    assert piped == ""
