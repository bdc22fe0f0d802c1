"""Progress bars for long operations (checkpoints, NVMe start-up): drawn on
stderr when it is a terminal, and by rank 0 only, so that a job's log
gets no bars and a console gets one per operation, not one per rank."""

from __future__ import annotations

from typing import IO, Optional

import torch.distributed as dist
from tqdm import tqdm


def progress_bar(
    description: str, total: int, unit: str = "B", enabled: bool = True, file: Optional[IO[str]] = None
) -> tqdm:
    """A bar over ``total`` bytes (or items of ``unit``), to update with
    ``bar.update(n)`` and close (or use as a context manager). It draws
    nothing where ``file`` (stderr by default) is not a terminal, on ranks
    other than 0, when not ``enabled``, and when there is nothing to do."""
    drawn = enabled and total > 0 and (not dist.is_initialized() or dist.get_rank() == 0)
    return tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=True,
        file=file,
        # None: tqdm's own check, drawn only where the stream is a terminal.
        disable=None if drawn else True,
    )
