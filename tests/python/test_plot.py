"""`zcore plot RUN_DIR`: PNGs of loss and learning rate, throughput, the
step-time split and memory by tier, drawn from a csv_monitor run directory
(DeepSpeed's CSV format, written here the way its csv_monitor writes it)."""

from __future__ import annotations

import csv
import math
import random
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from zcore import cli
from zcore.errors import InvalidArgumentError
from zcore.observe.plot import draw_pictures, file_name, read_run, read_series, write_plots

PICTURES = ("loss_lr.png", "throughput.png", "step_time.png", "memory.png")
GIB = 2**30


class CsvMonitor:
    """Writes events as DeepSpeed's csv_monitor does: one file per key, a
    header the first time this writer opens a file (so a restarted run
    writes it again), then `step,value` rows appended."""

    def __init__(self, job_dir: Path) -> None:
        job_dir.mkdir(parents=True, exist_ok=True)
        self.job_dir = job_dir
        self.opened: set[str] = set()

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for key, value, step in events:
            name = file_name(key)
            with (self.job_dir / name).open("a+", newline="") as f:
                writer = csv.writer(f)
                if name not in self.opened:
                    self.opened.add(name)
                    writer.writerow(["step", key.split("/")[-1]])
                writer.writerow([step, value])


def step_events(step: int, rng: random.Random, *, skipped_before: int, skip: bool,
                fp16: bool = True, nvme: bool = True) -> list[tuple[str, float, int]]:
    """One optimizer step of a 7B-parameter model on 4 ranks, fp16, with
    parameters and optimizer states on NVMe: 128 samples of 2048 tokens a
    step, warmup then cosine learning rate, loss falling with noise.
    Without fp16 the loss scale is 1 throughout (as zcore records it for
    bf16 and fp32); without NVMe the nvme tier holds 0 bytes."""
    samples = 128 * step
    loss = 2.2 + 8.6 * math.exp(-step / 45) + rng.gauss(0, 0.12)
    warmup, total = 20, 200
    lr = 3e-4 * (step / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))))
    scale = 2.0 ** (16 - skipped_before - skip + step // 80) if fp16 else 1.0
    parts = {
        "forward": rng.gauss(820, 40), "backward": rng.gauss(1650, 70), "step": rng.gauss(2300, 120),
        "comm_wait": rng.gauss(310, 60), "nvme_wait": max(0.0, rng.gauss(2900, 350)) if nvme else 0.0,
        "copy_wait": rng.gauss(420, 30), "other": rng.gauss(140, 25),
    }
    total_ms = sum(parts.values())
    train = {
        "train_loss": loss, "lr": lr, "loss_scale": scale,
        "grad_norm": math.inf if skip else 0.4 + 7.5 * math.exp(-step / 30) * rng.uniform(0.7, 1.3),
        "skipped_steps": skipped_before + skip,
        "samples_per_second": 128 / (total_ms / 1000), "tokens_per_second": 128 * 2048 / (total_ms / 1000),
        "tflops": 6 * 7e9 * 128 * 2048 / (total_ms / 1000) / 1e12,
        "elapsed_time_ms_total": total_ms, **{f"elapsed_time_ms_{k}": v for k, v in parts.items()},
    }
    memory = {
        "device/parameters": 1.6 * GIB, "device/gradients": 0.9 * GIB, "device/buffers": 0.35 * GIB,
        "device/activations": rng.uniform(9.5, 11.0) * GIB,
        "host/parameters": 2.1 * GIB, "host/gradients": 3.3 * GIB, "host/buffers": 4.0 * GIB,
        "host/process_rss": (12.2 + 0.004 * step) * GIB,
        "nvme/parameters": 3.26 * GIB, "nvme/optimizer_states": 19.6 * GIB if step > 1 else 0.0,
    }
    if not nvme:
        memory.update({"nvme/parameters": 0.0, "nvme/optimizer_states": 0.0})
    return [(f"Train/Samples/{k}", v, samples) for k, v in train.items()] + [
        (f"Memory/{k}", v, samples) for k, v in memory.items()
    ]


def write_run(job_dir: Path, steps: int = 200, *, resume_at: int = 1, seed: int = 0,
              fp16: bool = True, nvme: bool = True) -> None:
    """One process of a synthetic run writing steps ``resume_at`` to
    ``steps``; a second call with ``resume_at`` > 1 is a run restarted from
    a checkpoint into the same directory."""
    rng = random.Random(seed)
    # fp16's first steps overflow at the initial scale, then now and then.
    skips = {1, 2, 87, 140} if fp16 else set()
    monitor = CsvMonitor(job_dir)
    for step in range(resume_at, steps + 1):
        skipped_before = sum(1 for s in skips if s < step)
        monitor.write_events(step_events(step, rng, skipped_before=skipped_before, skip=step in skips,
                                         fp16=fp16, nvme=nvme))


def assert_png(path: Path) -> None:
    image = imread(path)
    height, width = image.shape[:2]
    assert 800 <= width <= 2000 and 500 <= height <= 1500, (path.name, image.shape)
    assert image[..., :3].std() > 0.05, f"{path.name} is blank"


def test_zcore_plot_writes_every_picture_of_a_run(tmp_path, capsys):
    write_run(tmp_path / "run" / "job", steps=60)
    assert cli.main(["plot", str(tmp_path / "run")]) == 0  # output_path given: its one job is found
    out, err = capsys.readouterr()
    assert out.split() == [str(tmp_path / "run" / name) for name in PICTURES]
    assert err == ""
    for name in PICTURES:
        assert_png(tmp_path / "run" / name)


def test_a_restarted_run_keeps_the_rows_written_after_the_restart(tmp_path):
    job = tmp_path / "job"
    loss_file = job / file_name("Train/Samples/train_loss")
    write_run(job, steps=30)
    with loss_file.open("a") as f:
        f.write(f"{128 * 31},")  # killed while writing: the restarted run's header lands on this line
    write_run(job, steps=40, resume_at=21, seed=1)
    loss = read_series(loss_file)
    assert loss.samples == [128.0 * s for s in range(1, 41)]
    assert loss.restarts == [128.0 * 21]
    with loss_file.open(newline="") as f:
        rows = [row for row in csv.reader(f) if row[0] == str(128 * 25)]
    assert len(rows) == 2 and loss.values[24] == float(rows[1][1])
    notes: list[str] = []
    written = write_plots(job, tmp_path / "pictures", note=notes.append)
    assert [p.name for p in written] == list(PICTURES)
    assert all(p.parent == tmp_path / "pictures" for p in written)
    assert notes == ["zcore plot: skipped 1 unreadable row(s) in Train_Samples_train_loss.csv"]


def test_missing_metrics_are_skipped_and_pictures_with_none_are_not_written(tmp_path):
    job = tmp_path / "job"
    write_run(job, steps=12)
    for prefix in ("Memory_", "Train_Samples_elapsed_time_ms_", "Train_Samples_tokens_per_second"):
        for path in job.glob(prefix + "*"):
            path.unlink()
    notes: list[str] = []
    written = write_plots(job, tmp_path / "out", note=notes.append)
    assert [p.name for p in written] == ["loss_lr.png", "throughput.png"]
    assert len(notes) == 2, notes
    assert "step_time.png not written" in notes[0] and "elapsed_time_ms" in notes[0]
    assert "memory.png not written" in notes[1] and "Memory/" in notes[1]


def test_directories_that_are_not_a_run_are_refused_with_what_they_hold(tmp_path, capsys):
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        write_plots(tmp_path / "absent")
    assert cli.main(["plot", str(tmp_path / "absent")]) == 1
    assert f"zcore plot: {tmp_path / 'absent'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty" / "logs").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("")
    with pytest.raises(InvalidArgumentError, match=r"no CSV files .* It holds: logs/, notes.txt"):
        write_plots(tmp_path / "empty")
    write_run(tmp_path / "two" / "a", steps=2)
    write_run(tmp_path / "two" / "b", steps=2)
    with pytest.raises(InvalidArgumentError, match=r"holds 2 csv_monitor jobs \(a, b\); pass one"):
        write_plots(tmp_path / "two")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(InvalidArgumentError, match="none of csv_monitor's metric files .* found: results.csv"):
        write_plots(tmp_path / "other")


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    write_run(tmp_path / "job", steps=2)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(ModuleNotFoundError, match=r"pip install matplotlib \(or pip install 'zcore\[monitors\]'\)"):
        write_plots(tmp_path / "job")


def panels(figure) -> list[str]:
    """Each panel of a picture, by its y label, or its title where the panels share one (memory)."""
    return [ax.get_title(loc="left").split(":")[0] or ax.get_ylabel() for ax in figure.axes]


def test_panels_without_information_are_left_out(tmp_path):
    write_run(tmp_path / "mixed", steps=60)
    write_run(tmp_path / "plain", steps=60, fp16=False, nvme=False)  # bf16 or fp32, states in memory
    mixed = draw_pictures(read_run(tmp_path / "mixed"))
    plain = draw_pictures(read_run(tmp_path / "plain"))
    assert panels(mixed["loss_lr.png"]) == ["training loss", "learning rate", "gradient norm (L2)", "loss scale (fp16)"]
    assert panels(plain["loss_lr.png"]) == ["training loss", "learning rate", "gradient norm (L2)"]
    assert panels(mixed["memory.png"]) == ["device (where the model computes)", "host memory", "NVMe"]
    assert panels(plain["memory.png"]) == ["device (where the model computes)", "host memory"]
    written = write_plots(tmp_path / "plain", tmp_path / "out")
    assert [p.name for p in written] == list(PICTURES)


def averages(figure) -> list:
    (loss_panel, *_) = figure.axes
    return [line for line in loss_panel.get_lines() if "moving average" in line.get_label()]


@pytest.mark.parametrize("steps, window", [(12, 3), (60, 3), (200, 11)])
def test_the_loss_moving_average_starts_at_the_first_step_and_names_its_window(tmp_path, steps, window):
    write_run(tmp_path / "job", steps=steps, fp16=False)
    loss = read_series(tmp_path / "job" / file_name("Train/Samples/train_loss")).values
    (average,) = averages(draw_pictures(read_run(tmp_path / "job"))["loss_lr.png"])
    assert f"loss, moving average of {window} steps" in average.get_label()
    y = list(average.get_ydata())
    assert len(y) == steps and all(math.isfinite(v) for v in y)
    # Centred on each step, narrowed near the ends so that it stays centred:
    # the first step is its own average, the window then grows by two a step.
    half = window // 2
    for i in range(steps):
        h = min(i, steps - 1 - i, half)
        assert y[i] == pytest.approx(sum(loss[i - h:i + h + 1]) / (2 * h + 1), rel=1e-12), i
    assert y[0] == pytest.approx(loss[0], rel=1e-12)


def test_a_run_of_a_few_steps_has_no_moving_average(tmp_path):
    write_run(tmp_path / "job", steps=4, fp16=False)
    assert averages(draw_pictures(read_run(tmp_path / "job"))["loss_lr.png"]) == []
