"""Where the step metrics go: DeepSpeed's three monitors, written on rank 0.

Each takes events as DeepSpeed's do, ``(key, value, samples)`` with keys
such as ``Train/Samples/train_loss`` (zcore.observe.step_metrics.StepRecord.events),
and writes them where DeepSpeed's would, so that a DeepSpeed user's
dashboards and scripts keep working:

- ``csv_monitor``: ``output_path/job_name/<key with / as _>.csv``, a
  ``step,<last part of the key>`` header, then one row per step (appended
  across runs, as DeepSpeed does). ``zcore plot`` reads these.
- ``tensorboard``: event files in ``output_path/job_name``.
- ``wandb``: ``wandb.init(project, group, entity=team)``; offline with
  wandb's own ``WANDB_MODE=offline``.
"""

from __future__ import annotations

import csv
import importlib
import weakref
from pathlib import Path
from typing import IO, Any, Protocol

from zcore.config.schema import Config, TensorBoardConfig, WandbConfig
from zcore.errors import ConfigError

Event = tuple[str, float, int]


class Monitor(Protocol):
    def write(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


def open_monitors(config: Config, rank: int) -> list[Monitor]:
    """The monitors the config enables, on rank 0 (none elsewhere)."""
    if rank != 0:
        return []
    monitors: list[Monitor] = []
    if config.csv_monitor.enabled:
        monitors.append(CsvMonitor(_log_dir(config.csv_monitor, "csv_monitor")))
    if config.tensorboard.enabled:
        monitors.append(TensorBoardMonitor(_log_dir(config.tensorboard, "tensorboard")))
    if config.wandb.enabled:
        monitors.append(WandbMonitor(config.wandb))
    return monitors


def _log_dir(section: TensorBoardConfig, key: str) -> Path:
    path = Path(section.output_path) / section.job_name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{key}: cannot create the log directory {str(path)!r} ({exc.strerror}); set "
            f"{key}.output_path to a writable directory"
        ) from None
    return path


def _require(package: str, key: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(
            f"{key}.enabled is true but the {package!r} package is not installed: pip install "
            f"{package} (or zcore[monitors]), or disable {key}"
        ) from None


class CsvMonitor:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[str, tuple[IO[str], Any]] = {}
        # An engine never destroyed still closes its files.
        weakref.finalize(self, _close_files, self._files)

    def write(self, events: list[Event]) -> None:
        for key, value, step in events:
            self._writer(key).writerow([step, value])
        for handle, _ in self._files.values():
            handle.flush()

    def _writer(self, key: str) -> Any:
        entry = self._files.get(key)
        if entry is None:
            path = self.directory / (key.replace("/", "_").replace(" ", "_") + ".csv")
            new = not path.exists() or path.stat().st_size == 0
            handle = open(path, "a", newline="")  # noqa: SIM115 - open for the run, closed by close()
            writer = csv.writer(handle)
            if new:
                writer.writerow(["step", key.rsplit("/", 1)[-1]])
            entry = self._files[key] = (handle, writer)
        return entry[1]

    def close(self) -> None:
        _close_files(self._files)


def _close_files(files: dict[str, tuple[IO[str], Any]]) -> None:
    for handle, _ in files.values():
        handle.close()
    files.clear()


class TensorBoardMonitor:
    def __init__(self, directory: Path) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self._writer = SummaryWriter(log_dir=str(directory))

    def write(self, events: list[Event]) -> None:
        for key, value, step in events:
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbMonitor:
    def __init__(self, section: WandbConfig) -> None:
        self._wandb = _require("wandb", "wandb")
        self._run = self._wandb.init(project=section.project, group=section.group, entity=section.team)
        self.directory = Path(self._run.dir).parent if self._run is not None else None

    def write(self, events: list[Event]) -> None:
        if events:
            self._run.log({key: value for key, value, _ in events}, step=events[0][2])

    def close(self) -> None:
        self._run.finish()


def close_all(monitors: list[Monitor]) -> None:
    """Closes every monitor, raising the first failure after all were tried."""
    first = None
    for monitor in monitors:
        try:
            monitor.close()
        except Exception as exc:  # noqa: BLE001 - re-raised below once all are closed
            first = first or exc
    if first is not None:
        raise first

