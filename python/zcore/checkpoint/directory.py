"""Where a checkpoint's files are, and the names that may appear in them.

    DIR/latest                      the tag to resume from, replaced last
    DIR/TAG/meta.json               written last inside a tag: what was saved
    DIR/TAG/rank-00000.json         each rank's index: ranges and checksums
    DIR/TAG/weights-00000.safetensors   fp32 master ranges, frozen parameters, buffers
    DIR/TAG/state-00000.safetensors     optimizer states, RNG, client tensors
    DIR/.TAG.partial/               a save in progress (renamed to TAG when complete)

Names read back from metadata (the tag in ``latest``, file names) are
checked to be single plain path components, so a checkpoint can never make
zcore read or write outside its directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from zcore.errors import CheckpointError

FORMAT = "zcore-checkpoint"
VERSION = 1
LATEST = "latest"
META = "meta.json"

_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}")


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _PLAIN.fullmatch(name) or ".." in name:
        raise CheckpointError(
            f"{what} {name!r} is not a plain file name (letters, digits, '_.+=-', not starting with "
            "'.', no '..', at most 200 characters): checkpoint names never leave their directory"
        )
    return name


def rank_index(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def weights_file(rank: int) -> str:
    return f"weights-{rank:05d}.safetensors"


def state_file(rank: int) -> str:
    return f"state-{rank:05d}.safetensors"


def staging_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.partial"


def read_latest(root: Path) -> Optional[str]:
    path = root / LATEST
    if not path.exists():
        return None
    return check_name(path.read_text().strip(), f"the tag in {path}")


def tags_in(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / META).is_file())
