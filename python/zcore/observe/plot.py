"""``zcore plot RUN_DIR``: pictures of a run from its ``csv_monitor`` files.

The input is DeepSpeed's CSV format, which zcore's ``csv_monitor`` writes:
in ``output_path/job_name/``, one file per metric key, named after the key
with ``/`` and spaces replaced by ``_`` (``Train_Samples_train_loss.csv``),
holding a header ``step,<last part of the key>`` and then ``<step>,<value>``
rows. The step column is the number of samples seen (global_samples), so
every x axis here is samples.

A run that restarts from a checkpoint appends to the same files (and, as
DeepSpeed does, writes the header again). Its rows supersede the earlier
run's from the sample it resumed at: once a file's step stops increasing,
the rows already read from that step on are dropped. The pictures mark each
such restart with a dashed vertical line.

matplotlib is imported only here, when a picture is drawn, through its
object API (``Figure``, no pyplot): it needs no display and leaves the
caller's pyplot state alone.
"""

from __future__ import annotations

import bisect
import csv
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zcore.errors import InvalidArgumentError

_TRAIN = "Train/Samples/"
SAMPLES_AXIS = "samples seen (all ranks; csv_monitor's step column)"

LOSS_KEYS = ("train_loss", "lr", "grad_norm", "loss_scale")
THROUGHPUT = (  # key, y label, legend unit
    ("samples_per_second", "samples / s", "samples/s"),
    ("tokens_per_second", "tokens / s", "tokens/s"),
    ("tflops", "TFLOPS achieved (all ranks)", "TFLOPS"),
)
# The exclusive parts of elapsed_time_ms_total, bottom of the stack first.
STEP_PARTS = (
    ("elapsed_time_ms_forward", "forward"),
    ("elapsed_time_ms_backward", "backward"),
    ("elapsed_time_ms_step", "optimizer step"),
    ("elapsed_time_ms_comm_wait", "waiting on collectives"),
    ("elapsed_time_ms_nvme_wait", "waiting on NVMe"),
    ("elapsed_time_ms_copy_wait", "host<->device copies"),
    ("elapsed_time_ms_other", "other (data loading, user code)"),
)
STEP_TOTAL = "elapsed_time_ms_total"
TIERS = (("device", "device (where the model computes)"), ("host", "host memory"), ("nvme", "NVMe"))
CATEGORIES = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_states", "optimizer states"),
    ("buffers", "buffers"),
    ("activations", "activations"),
)
RSS = "Memory/host/process_rss"

_RESTART_STYLE = {"color": "0.35", "linestyle": "--", "linewidth": 1.0}


def file_name(key: str) -> str:
    """The file csv_monitor writes ``key`` to, as DeepSpeed names it."""
    return key.replace("/", "_").replace(" ", "_") + ".csv"


@dataclass
class Series:
    """One metric over the run, in sample order, restarts already resolved."""

    samples: list[float]
    values: list[float]
    restarts: list[float]  # samples at which a restarted run resumed
    unreadable_rows: int  # rows that were neither a header nor two numbers


@dataclass
class Run:
    """The metrics of one csv_monitor job directory, by key."""

    job_dir: Path
    metrics: dict[str, Series] = field(default_factory=dict)

    def get(self, key: str) -> Series | None:
        return self.metrics.get(key)

    def restarts(self) -> list[float]:
        return sorted({s for series in self.metrics.values() for s in series.restarts})


def _all_keys() -> list[str]:
    keys = [_TRAIN + k for k in (*LOSS_KEYS, "skipped_steps", STEP_TOTAL)]
    keys += [_TRAIN + k for k, _, _ in THROUGHPUT] + [_TRAIN + k for k, _ in STEP_PARTS]
    keys += [f"Memory/{tier}/{category}" for tier, _ in TIERS for category, _ in CATEGORIES]
    return [*keys, RSS]


def find_job_dir(run_dir: Path) -> Path:
    """The directory holding the CSV files: ``run_dir`` itself, or its one
    subdirectory that holds them (csv_monitor's ``output_path`` given
    instead of ``output_path/job_name``)."""
    if not run_dir.is_dir():
        what = "does not exist" if not run_dir.exists() else "is not a directory"
        raise InvalidArgumentError(f"zcore plot: {run_dir} {what}; pass csv_monitor's job directory",
                                   run_dir=str(run_dir))
    if any(run_dir.glob("*.csv")):
        return run_dir
    jobs = sorted(d for d in run_dir.iterdir() if d.is_dir() and any(d.glob("*.csv")))
    if len(jobs) == 1:
        return jobs[0]
    if jobs:
        names = ", ".join(d.name for d in jobs)
        raise InvalidArgumentError(
            f"zcore plot: {run_dir} holds {len(jobs)} csv_monitor jobs ({names}); pass one of them",
            run_dir=str(run_dir))
    held = sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir())
    shown = ", ".join(held[:20]) + (f", ... ({len(held)} in all)" if len(held) > 20 else "")
    raise InvalidArgumentError(
        f"zcore plot: no CSV files in {run_dir} or in a subdirectory of it; expected csv_monitor's "
        f"output_path/job_name/ with files such as {file_name(_TRAIN + 'train_loss')}. "
        f"It holds: {shown or 'nothing'}",
        run_dir=str(run_dir))


def read_series(path: Path) -> Series:
    """Reads one csv_monitor file, resolving restarts (see the module note)."""
    samples: list[float] = []
    values: list[float] = []
    restarts: list[float] = []
    unreadable = 0
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if not row or row[0] == "step":  # a blank line, or the header a restarted run writes again
                continue
            try:
                sample, value = float(row[0]), float(row[1])
            except (ValueError, IndexError):  # e.g. the half-written last line of a killed run
                unreadable += 1
                continue
            if samples and sample <= samples[-1]:
                keep = bisect.bisect_left(samples, sample)
                del samples[keep:], values[keep:]
                restarts.append(sample)
            samples.append(sample)
            values.append(value)
    return Series(samples, values, restarts, unreadable)


def read_run(job_dir: Path) -> Run:
    """Every known metric file of the job; unknown files are ignored."""
    run = Run(job_dir)
    for key in _all_keys():
        path = job_dir / file_name(key)
        if path.is_file():
            series = read_series(path)
            if series.samples:
                run.metrics[key] = series
    if not run.metrics:
        found = ", ".join(sorted(p.name for p in job_dir.glob("*.csv"))[:20])
        raise InvalidArgumentError(
            f"zcore plot: none of csv_monitor's metric files in {job_dir} (such as "
            f"{file_name(_TRAIN + 'train_loss')} or {file_name('Memory/device/parameters')}); found: {found}",
            job_dir=str(job_dir))
    return run


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def write_plots(run_dir: str | Path, output_dir: str | Path | None = None,
                note: Callable[[str], None] = _stderr) -> list[Path]:
    """Writes ``loss_lr.png``, ``throughput.png``, ``step_time.png`` and
    ``memory.png`` for the run into ``output_dir`` (default ``run_dir``) and
    returns their paths. A picture none of whose metrics the run recorded is
    not written; ``note`` gets one line saying so, and one per file with rows
    that could not be read."""
    run_dir = Path(run_dir)
    run = read_run(find_job_dir(run_dir))
    pictures = draw_pictures(run)
    out = Path(output_dir) if output_dir is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    for key, series in run.metrics.items():
        if series.unreadable_rows:
            note(f"zcore plot: skipped {series.unreadable_rows} unreadable row(s) in {file_name(key)}")
    written = []
    for name, _, inputs in _PICTURES:
        if name not in pictures:
            note(f"zcore plot: {name} not written: the run has none of {inputs}")
            continue
        path = out / name
        pictures[name].savefig(path)
        written.append(path)
    return written


def draw_pictures(run: Run) -> dict[str, Any]:
    """The pictures ``write_plots`` writes, by file name, as matplotlib
    Figures (each of its panels an Axes in ``figure.axes``); a picture
    none of whose metrics the run recorded is left out."""
    figure_class = _matplotlib_figure()
    pictures = {}
    for name, draw, _ in _PICTURES:
        figure = figure_class(figsize=(12, 8), dpi=110, layout="constrained")
        if draw(figure, run):
            pictures[name] = figure
    return pictures


def _matplotlib_figure() -> type:
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "zcore plot needs matplotlib: pip install matplotlib (or pip install 'zcore[monitors]')",
            name="matplotlib") from exc
    return Figure


# Drawing. Each picture function fills a Figure and returns False when the
# run has none of its metrics. A panel is drawn only where it says
# something: no loss-scale panel for a constant scale (bf16 or fp32 record
# 1.0 each step; a static fp16 scale never moves), no memory tier holding
# no bytes (NVMe without NVMe offload).


def _loss_lr(figure: Any, run: Run) -> bool:
    present = [k for k in LOSS_KEYS if run.get(_TRAIN + k)]
    if "loss_scale" in present and not _varies(run.get(_TRAIN + "loss_scale")):
        present.remove("loss_scale")
    if not present:
        return False
    _title(figure, run, "Loss and learning rate")
    axes = _panels(figure, len(present), heights=[2 if k == "train_loss" else 1 for k in present])
    for ax, key in zip(axes, present):
        series = run.get(_TRAIN + key)
        if key == "train_loss":
            _noisy_line(ax, series, "loss", "C0")
            _mark_skipped(ax, series, run.get(_TRAIN + "skipped_steps"))
            ax.set_ylabel("training loss")
        elif key == "lr":
            ax.plot(series.samples, series.values, color="C2", label="learning rate", **_short(series))
            ax.set_ylabel("learning rate")
            ax.yaxis.set_major_formatter(_formatter(_small_number))
        elif key == "grad_norm":
            _noisy_line(ax, series, "gradient norm", "C1")
            ax.set_ylabel("gradient norm (L2)")
        else:
            ax.plot(series.samples, series.values, color="C4", drawstyle="steps-post", label="loss scale",
                    **_short(series))
            ax.set_yscale("log", base=2)
            ax.set_ylabel("loss scale (fp16)")
    _finish(axes, run)
    return True


def _throughput(figure: Any, run: Run) -> bool:
    present = [(k, label, unit) for k, label, unit in THROUGHPUT if run.get(_TRAIN + k)]
    if not present:
        return False
    _title(figure, run, "Throughput")
    axes = _panels(figure, len(present))
    for ax, (key, label, unit) in zip(axes, present):
        series = run.get(_TRAIN + key)
        number = _count if key == "tokens_per_second" else _plain
        _noisy_line(ax, series, unit, "C0", summary=lambda v, n=number, u=unit: f"median {n(v)} {u}")
        ax.set_ylabel(label)
        _from_zero(ax)
        ax.yaxis.set_major_formatter(_formatter(number))
    _finish(axes, run)
    return True


def _step_time(figure: Any, run: Run) -> bool:
    parts = [(run.get(_TRAIN + k), label) for k, label in STEP_PARTS if run.get(_TRAIN + k)]
    total = run.get(_TRAIN + STEP_TOTAL)
    if not parts and not total:
        return False
    import numpy as np

    _title(figure, run, "Where each step's time goes (stacked)")
    ax = figure.add_subplot()
    if parts:
        x, stacked = _aligned([series for series, _ in parts])
        whole = float(np.sum(stacked, axis=0).mean())
        labels = [f"{label}: {y.mean():,.0f} ms" + (f" ({100 * y.mean() / whole:.0f}%)" if whole > 0 else "")
                  for (_, label), y in zip(parts, stacked)]
        ax.stackplot(x, stacked, labels=labels, colors=[f"C{i}" for i in range(len(parts))], alpha=0.85,
                     linewidth=0)
    if total:
        mean = sum(total.values) / len(total.values)
        ax.plot(total.samples, total.values, color="black", linewidth=1.0,
                label=f"total step time, measured: {mean:,.0f} ms", **_short(total))
    ax.set_ylabel("time per step (ms)")
    _from_zero(ax)
    ax.yaxis.set_major_formatter(_formatter(_plain))
    _finish([ax], run, legend_title="mean per step (share)")
    return True


def _memory(figure: Any, run: Run) -> bool:
    tiers = []
    for tier, title in TIERS:
        held = [(run.get(f"Memory/{tier}/{c}"), i, label) for i, (c, label) in enumerate(CATEGORIES)
                if _holds_bytes(run.get(f"Memory/{tier}/{c}"))]
        rss = run.get(RSS) if tier == "host" else None
        if held or rss:
            tiers.append((title, held, rss))
    if not tiers:
        return False
    import numpy as np

    _title(figure, run, "Memory per rank, by tier and category (stacked)")
    axes = _panels(figure, len(tiers))
    for ax, (title, held, rss) in zip(axes, tiers):
        peaks = [max(rss.values)] if rss else []
        if held:
            x, stacked = _aligned([series for series, _, _ in held])
            peaks.append(float(np.sum(stacked, axis=0).max()))
        unit, scale = _byte_unit(max(peaks))
        if held:
            ax.stackplot(x, [y / scale for y in stacked], labels=[label for _, _, label in held],
                         colors=[f"C{i}" for _, i, _ in held], alpha=0.85, linewidth=0)
        if rss:
            ax.plot(rss.samples, [v / scale for v in rss.values], color="black", linewidth=1.5,
                    label="process resident set (RSS):\nall host memory the process holds", **_short(rss))
        ax.set_title(f"{title}: peak {max(peaks) / scale:,.1f} {unit}", loc="left", fontsize=11)
        ax.set_ylabel(f"{unit} per rank")
        _from_zero(ax)
        ax.yaxis.set_major_formatter(_formatter(_plain))
    _finish(axes, run)
    return True


_PICTURES = (
    ("loss_lr.png", _loss_lr, ", ".join(_TRAIN + k for k in LOSS_KEYS)),
    ("throughput.png", _throughput, ", ".join(_TRAIN + k for k, _, _ in THROUGHPUT)),
    ("step_time.png", _step_time, f"{_TRAIN}elapsed_time_ms_*"),
    ("memory.png", _memory, "Memory/<tier>/<category>, " + RSS),
)


# Shared pieces of the pictures.


def _title(figure: Any, run: Run, text: str) -> None:
    figure.suptitle(f"{text}: {run.job_dir.name}", fontsize=14)


def _panels(figure: Any, count: int, heights: Sequence[int] | None = None) -> list[Any]:
    """``count`` panels stacked vertically, sharing the samples axis."""
    grid = figure.add_gridspec(count, 1, height_ratios=heights)
    axes = [figure.add_subplot(grid[0])]
    axes += [figure.add_subplot(grid[i], sharex=axes[0]) for i in range(1, count)]
    return axes


def _finish(axes: list[Any], run: Run, legend_title: str | None = None) -> None:
    """Samples axis on the bottom panel, restart lines (in the top panel's
    legend only), grids, legends outside the data (right of each panel)."""
    from matplotlib.collections import PolyCollection

    for ax in axes:
        for i, sample in enumerate(run.restarts()):
            named = i == 0 and ax is axes[0]
            ax.axvline(sample, label="run restarted here" if named else None, **_RESTART_STYLE)
        ax.grid(True, alpha=0.3)
        # Stacked areas listed top layer first, as they appear on the panel.
        entries = list(zip(*ax.get_legend_handles_labels()))
        areas = [e for e in entries if isinstance(e[0], PolyCollection)]
        ordered = areas[::-1] + [e for e in entries if not isinstance(e[0], PolyCollection)]
        ax.legend(*zip(*ordered), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=10, frameon=False,
                  title=legend_title, title_fontsize=10, alignment="left")
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    axes[-1].set_xlabel(SAMPLES_AXIS)
    axes[-1].xaxis.set_major_formatter(_formatter(_count))
    axes[0].set_xlim(left=0)


def _varies(series: Series) -> bool:
    """Whether the series takes more than one (finite) value."""
    finite = {v for v in series.values if math.isfinite(v)}
    return len(finite) > 1


def _holds_bytes(series: Series | None) -> bool:
    return series is not None and any(math.isfinite(v) and v > 0 for v in series.values)


def _from_zero(ax: Any) -> None:
    """A y axis from 0 with room above the highest point, which would
    otherwise sit on the frame."""
    top = ax.dataLim.y1
    if math.isfinite(top) and top > 0:
        ax.set_ylim(0, top * 1.08)
    else:
        ax.set_ylim(bottom=0)


def _short(series: Series) -> dict[str, Any]:
    """Markers on series short enough that a line alone hides where the points are."""
    return {"marker": "o", "markersize": 4} if len(series.samples) < 30 else {}


# Fewer points than this get no moving average: a line through them says it all.
_MIN_SMOOTHED = 5


def _moving_average_window(points: int) -> int:
    """The moving average's window for a series of ``points`` steps, sized
    to the run: an odd number of steps, about a 20th of the run, from 3
    up to 501 (0: too few points to average)."""
    if points < _MIN_SMOOTHED:
        return 0
    return 2 * max(1, min(250, points // 40)) + 1


def _noisy_line(ax: Any, series: Series, name: str, color: str,
                summary: Callable[[float], str] | None = None) -> None:
    """The raw values faintly, and on top their moving average from the
    first step, its window named in the legend."""
    import numpy as np

    y = np.asarray(series.values, dtype=float)
    finite = y[np.isfinite(y)]
    label = f"{name}, each step"
    if summary is not None and finite.size:
        label += f" ({summary(float(np.median(finite)))})"
    window = _moving_average_window(len(y))
    ax.plot(series.samples, np.where(np.isfinite(y), y, np.nan), color=color, linewidth=0.8,
            alpha=0.35 if window else 1.0, label=label, **_short(series))
    if window:
        ax.plot(series.samples, _moving_average(y, window), color=color, linewidth=2.0,
                label=f"{name}, moving average of {window} steps\n(centred; fewer near the ends)")


def _moving_average(y: Any, window: int) -> Any:
    """Mean of the ``window`` points centred on each, so that it does not
    lag the data. Near the ends the window narrows to stay centred (the
    first and last points are their own average; it grows by two per step
    to ``window``), so a falling loss is not dragged down by later steps at
    the start. NaN and infinity (an overflowed step's gradient norm) are
    left out."""
    import numpy as np

    finite = np.isfinite(y)
    sums = np.concatenate(([0.0], np.cumsum(np.where(finite, y, 0.0))))
    counts = np.concatenate(([0], np.cumsum(finite)))
    index = np.arange(len(y))
    half = np.minimum(np.minimum(index, len(y) - 1 - index), window // 2)
    start, end = index - half, index + half + 1
    n = counts[end] - counts[start]
    return np.where(n > 0, (sums[end] - sums[start]) / np.maximum(n, 1), np.nan)


def _mark_skipped(ax: Any, loss: Series, skipped: Series | None) -> None:
    """A marker on the loss curve at each step whose update was skipped (the
    cumulative skipped_steps count rose there)."""
    if skipped is None:
        return
    import numpy as np

    counts = [0.0, *skipped.values]
    at = [s for s, before, now in zip(skipped.samples, counts, counts[1:]) if now > before]
    if not at:
        return
    x = np.asarray(loss.samples, dtype=float)
    y = np.asarray(loss.values, dtype=float)
    finite = np.isfinite(y)
    if not finite.any():
        return
    ax.plot(at, np.interp(at, x[finite], y[finite]), linestyle="none", marker="v", markersize=8,
            color="C3", label=f"skipped step (update not applied): {len(at)}")


def _aligned(series: Sequence[Series]) -> tuple[Any, Any]:
    """The series on the union of their samples, for stacking: each holds
    its last recorded value until its next one, and counts 0 before its
    first."""
    import numpy as np

    x = np.unique(np.concatenate([np.asarray(s.samples, dtype=float) for s in series]))
    rows = []
    for s in series:
        at = np.searchsorted(np.asarray(s.samples, dtype=float), x, side="right") - 1
        values = np.asarray(s.values, dtype=float)
        rows.append(np.where(at >= 0, values[np.maximum(at, 0)], 0.0))
    return x, np.nan_to_num(np.vstack(rows), nan=0.0, posinf=0.0, neginf=0.0)


def _byte_unit(peak: float) -> tuple[str, float]:
    """The binary unit that shows ``peak`` bytes as a number from 1 to 1023."""
    for unit, scale in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if peak >= scale:
            return unit, scale
    return "bytes", 1.0


def _count(value: float) -> str:
    """12500 -> '12.5k', 3000000 -> '3M': tick labels a person reads at once."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _plain(value: float) -> str:
    """12.5 -> '12.5', 1290.3 -> '1,290': whole numbers from 100 up."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _small_number(value: float) -> str:
    """Learning rates: '3e-4' rather than an offset printed apart from the ticks."""
    if value == 0 or 1e-2 <= abs(value) < 1e4:
        return f"{value:.3g}"
    exponent = math.floor(math.log10(abs(value)))
    return f"{value / 10**exponent:.3g}e{exponent}"


def _formatter(format_value: Callable[[float], str]) -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _position: format_value(value))
