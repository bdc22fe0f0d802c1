"""Where a checkpoint's files are, and the names that may appear in them.

    DIR/latest                      the tag to resume from, replaced last
    DIR/TAG/meta.json               written last inside a tag: what was saved
    DIR/TAG/rank-00000.json         each rank's index: ranges and checksums
    DIR/TAG/weights-00000.safetensors   fp32 master ranges, frozen parameters, buffers
    DIR/TAG/state-00000.safetensors     optimizer states, RNG, client tensors
    DIR/TAG/owner.json              who saved it (host, process): written first
    DIR/.TAG.partial/               a save in progress (renamed to TAG when complete)

Names read back from metadata (the tag in ``latest``, file names) are
checked to be single plain path components, so a checkpoint can never make
zcore read or write outside its directory. A tag to save is also checked
against the directory: it cannot be ``latest`` (nor start with '.', the
names of staging and temporary files), and it cannot replace an entry that
is not a zcore checkpoint (a user's ``notes.txt``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from zcore.comm import collectives as comm
from zcore.checkpoint.files import JSON_BYTES, LATEST_BYTES, read_small, shown
from zcore.errors import CheckpointError

FORMAT = "zcore-checkpoint"
VERSION = 1
LATEST = "latest"
META = "meta.json"
OWNER = "owner.json"
TAG_RULE = (
    "letters, digits and '_.+=-', not starting with '.', no '..', at most 200 characters, "
    f"not {LATEST!r}"
)

_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}")


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _PLAIN.fullmatch(name) or ".." in name:
        raise CheckpointError(
            f"{what} {shown(name)} is not a plain file name (letters, digits, '_.+=-', not starting "
            "with '.', no '..', at most 200 characters): checkpoint names never leave their directory"
        )
    return name


def check_tag(tag: str, what: str = "tag") -> str:
    """A tag: a plain name that is not one of the directory's own files."""
    if tag == LATEST:
        raise CheckpointError(
            f"{what} {tag!r} is the name of the file that records the latest tag; allowed tags: {TAG_RULE}"
        )
    try:
        return check_name(tag, what)
    except CheckpointError:
        raise CheckpointError(
            f"{what} {shown(tag)} is not a plain file name; allowed tags: {TAG_RULE} (checkpoint names "
            "never leave their directory)"
        ) from None


def check_same_tag(tag: Optional[str], doing: str) -> None:
    """A collective: every rank names the same tag (all one directory), or
    every rank raises an error listing each rank's tag."""
    tags = comm.all_gather_strings(tag)
    if len(set(tags)) > 1:
        listed = ", ".join(f"rank {r}: {shown(t) if t is not None else 'none (latest)'}" for r, t in enumerate(tags))
        raise CheckpointError(
            f"{doing}: the checkpoint tags differ across ranks ({listed}); every rank writes and reads "
            "one tag directory together, so pass the same tag on every rank"
        )


def check_tag_free(root: Path, tag: str) -> None:
    """Saving ``tag`` into ``root`` replaces only a zcore checkpoint."""
    target = root / tag
    if (target.exists() or target.is_symlink()) and not is_checkpoint(target):
        raise CheckpointError(
            f"cannot save tag {tag!r}: {target} exists and is not a zcore checkpoint directory, and a "
            "save would replace it; choose another tag or move it away"
        )


def rank_index(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def weights_file(rank: int) -> str:
    return f"weights-{rank:05d}.safetensors"


def state_file(rank: int) -> str:
    return f"state-{rank:05d}.safetensors"


def staging_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.partial"


def is_checkpoint(path: Path) -> bool:
    """A directory (not a link) holding a meta.json that says it is zcore's."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        content = json.loads(read_small(path / META, JSON_BYTES))["content"]
        return content["format"] == FORMAT
    except (OSError, CheckpointError, ValueError, KeyError, TypeError, RecursionError):
        return False


def read_latest(root: Path) -> Optional[str]:
    path = root / LATEST
    if not path.exists() and not path.is_symlink():
        return None
    try:
        text = read_small(path, LATEST_BYTES).decode()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not text: it holds no tag; remove it or name the tag to load") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}", path=str(path)) from None
    return check_tag(text.strip(), f"the tag in {path}")


def tags_in(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / META).is_file())
