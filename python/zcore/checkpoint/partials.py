"""Staging directories (``.TAG.partial``) left by killed saves, and the rule
for removing them.

Rank 0 makes a save's staging directory and, before anything else, writes
``owner.json`` into it: this host, this process (pid and start time), and
when. Only a directory holding a readable marker is zcore's; nothing else is
ever removed, except a directory that is empty or holds only the marker's
temporary file (a save killed while marking it), when it is older than this
process. At the start of every save and load, rank 0 removes each of
zcore's partials in the directory whose owner is gone:

- on this host, when its process no longer runs (pid and start time, so a
  reused pid does not count as the owner) or is this very process (a save
  runs to its end or cleans up before the call returns), unless this
  process writes it in the background (``hold``: an asynchronous save,
  zcore.checkpoint.async_save);
- on another host, whose processes zcore cannot see, when it was created
  before this process started: a job does not outlive a killed save of its
  own, and two jobs never save into one directory at once (they would also
  fight over ``latest``), so a partial older than this job belongs to a job
  that died.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Optional

from zcore.checkpoint import directory, durable
from zcore.checkpoint.files import JSON_BYTES, read_small
from zcore.errors import CheckpointError

log = logging.getLogger("zcore")

_SUFFIX = ".partial"


def _start_ticks(pid: int) -> Optional[int]:
    """A process's start time (clock ticks since boot), None when it does not run."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name may hold spaces


_BOOT = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


@functools.cache
def _process(pid: int) -> dict:
    """This process as owner.json records it. Asked for by pid, not taken
    at import: a process forked after importing zcore is another owner."""
    return {"host": socket.gethostname(), "pid": pid, "start_ticks": _start_ticks(pid)}


def _self() -> dict:
    return _process(os.getpid())


def _started() -> float:
    """When this process started (seconds since the epoch)."""
    return _BOOT + (_self()["start_ticks"] or 0) / os.sysconf("SC_CLK_TCK")


def _owner(partial: Path) -> Optional[dict]:
    try:
        owner = json.loads(read_small(partial / directory.OWNER, JSON_BYTES))["content"]
        valid = (
            isinstance(owner["host"], str)
            and all(isinstance(owner[k], int) for k in ("pid", "start_ticks"))
            and isinstance(owner["created"], (int, float))
        )
        return owner if valid else None
    except (OSError, CheckpointError, ValueError, KeyError, TypeError, RecursionError):
        return None


# Staging directories this process writes in the background. Set-add and
# discard are atomic under the GIL; the writer thread releases its own.
_held: set[Path] = set()


def hold(staging: Path) -> None:
    """``staging`` is being written by this process in the background: not abandoned."""
    _held.add(Path(staging).absolute())


def release(staging: Path) -> None:
    _held.discard(Path(staging).absolute())


def _abandoned(owner: dict) -> bool:
    me = _self()
    if owner["host"] != me["host"]:
        return owner["created"] < _started()
    if owner["pid"] == me["pid"] and owner["start_ticks"] == me["start_ticks"]:
        return True
    return _start_ticks(owner["pid"]) != owner["start_ticks"]


def _abandoned_dir(path: Path) -> bool:
    owner = _owner(path)
    if owner is not None:
        return _abandoned(owner)
    # Unmarked: zcore's only when empty or holding the marker's temporary file
    # (a save killed while marking it), then by its age alone.
    try:
        unmarked = set(os.listdir(path)) <= {f".{directory.OWNER}.tmp"}
        return unmarked and path.stat().st_mtime < _started()
    except OSError:
        return False


def remove_abandoned(root: Path) -> None:
    """Removes zcore's abandoned partials in ``root``. Failing to is logged,
    not raised: the save or load at hand does not depend on it."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if not (path.name.startswith(".") and path.name.endswith(_SUFFIX)) or path.is_symlink() or not path.is_dir():
            continue
        if path.absolute() in _held:
            continue
        if not _abandoned_dir(path):
            continue
        try:
            shutil.rmtree(path)
            log.info("zcore: removed %s, left by a save that did not finish", path)
        except OSError as exc:
            log.warning("zcore: cannot remove %s, left by a save that did not finish: %s", path, exc.strerror)


def start(staging: Path) -> None:
    """Rank 0, at the start of a save: abandoned partials removed, then the
    staging directory made, marked as this process's."""
    remove_abandoned(staging.parent)
    if staging.exists() or staging.is_symlink():
        with contextlib.suppress(OSError):
            staging.rmdir()  # empty: a save killed between making it and marking it
    if staging.exists() or staging.is_symlink():
        owner = _owner(staging)
        whose = "is not zcore's (no owner.json)" if owner is None else (
            f"belongs to a save in progress (process {owner['pid']} on {owner['host']})"
        )
        raise CheckpointError(
            f"cannot stage the save in {staging}: it exists and {whose}; wait for that save, "
            "save under another tag, or remove it"
        )
    durable.make_dir(staging)
    try:
        durable.write_json(staging / directory.OWNER, {**_self(), "created": time.time()})
    except BaseException:
        staging.rmdir()
        raise
