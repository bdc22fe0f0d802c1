"""``save_checkpoint(..., async_save=True)``: copy now, write in the background.

The training thread prepares the save as a synchronous save does (its
checks and collectives on the training's process group), copies this
rank's payload into host memory (zcore.checkpoint.snapshot), agrees with
every rank that the copy succeeded, and returns. A background thread then
writes the copy with the synchronous save's own code (zcore.checkpoint.save
``write_save``): the same files, byte for byte, published by the same
atomic rename, so a process killed during the write leaves the previous
checkpoint as it was.

Where every value lives in memory, the values only the optimizer step or a
load changes are copied by the background thread instead, before it
writes, while the next forward and backward run: the loop waits only for
the copy of what a forward or the caller may change. Whatever changes the
settled values first waits for that copy (``finish_copies``): the engine's
optimizer step, a load's commit, and a GatheredParameters block that
writes its values back. Its failure is agreed over the writer's group
like a write's.

The writer's collectives (agreement on success, the indexes' checksums) go
over a gloo group of their own, made at the first asynchronous save and
destroyed by ``close``: on the training's group they would interleave with
the training's collectives, which run meanwhile from another thread.

Failures of the background write are agreed by every rank's writer, so
every rank holds an error of the same class (the one a synchronous save
raises) and raises it at its next save, ``wait``, load or ``close``.
At process exit, a pending write is finished (``_finish_at_exit``); a
failure then can only be logged. Call ``engine.wait_for_checkpoint()``
before ``torch.distributed.destroy_process_group()``, which would destroy
the writer's group under it.
"""

from __future__ import annotations

import atexit
import copy
import enum
import logging
import sys
import threading
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from zcore.comm import collectives as comm
from zcore.checkpoint import partials
from zcore.checkpoint.directory import staging_dir
from zcore.checkpoint.save import SaveJob, prepare_save, write_save
from zcore.checkpoint.snapshot import SnapshotBuffer
from zcore.errors import CheckpointError, InvalidStateError

log = logging.getLogger("zcore")


class SaveState(enum.Enum):
    """Where an engine's asynchronous save is; one at a time. The writer
    thread moves WRITING to WRITTEN or FAILED, and nothing else; the
    training thread reads those only after joining it."""

    IDLE = "idle"  # none pending: a save may copy into the buffer
    WRITING = "writing"  # the background thread writes the copy
    WRITTEN = "written"  # the write finished and is published; not yet collected by wait
    FAILED = "failed"  # the write failed: its error awaits the next save, wait, load or close
    CLOSED = "closed"  # closed: the writer's group and the buffer are gone


class AsyncCheckpointer:
    """An engine's asynchronous saves: the state, the thread, the writer's
    group and the host buffer, owned here alone."""

    def __init__(self) -> None:
        self.state = SaveState.IDLE
        self._failure: Optional[BaseException] = None  # FAILED: what the writer raised
        self._tag = ""  # of the save pending, for messages
        self._thread: Optional[threading.Thread] = None
        self._group: Optional[dist.ProcessGroup] = None  # the writer's (None: a world of one)
        self._group_made = False
        self._buffer = SnapshotBuffer()
        self._copied = threading.Event()  # set: no copy is pending in the background
        self._copied.set()
        _LIVE.add(self)

    @property
    def held_bytes(self) -> int:
        """Host memory held for the copy (zcore.checkpoint.snapshot)."""
        return self._buffer.held_bytes

    def save(self, engine: Any, save_dir: str | Path, tag: Optional[str], client_state: Any) -> Path:
        """IDLE -> WRITING, after ``wait``. Collective: prepares and copies
        this save, then starts its write; returns the tag directory it will
        be published as."""
        self.wait()
        if self.state is SaveState.CLOSED:
            raise InvalidStateError(
                "engine.save_checkpoint(async_save=True): the engine was destroyed, and its checkpoint writer "
                "with it; build a new engine with zcore.initialize to save again"
            )
        job = prepare_save(engine, save_dir, tag, client_state)
        group = self._writer_group()
        # Every rank decides alike: a deferred copy's failure is agreed in the background.
        defer = all(v == "True" for v in comm.all_gather_strings(str(job.payload.in_memory)))
        failure, finish = None, None
        try:
            # meta is JSON built now; a deep copy keeps it apart from whatever it was read from.
            payload, finish = self._buffer.copy(job.payload, defer_settled=defer)
            job = replace(job, payload=payload, meta=copy.deepcopy(job.meta))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before any writer starts
            failure = exc
        comm.raise_if_any_failed(failure, "copying the checkpoint to host memory", CheckpointError)
        partials.hold(staging_dir(job.root, job.tag))
        self._tag = job.tag
        self._thread = threading.Thread(
            target=self._write, args=(job, group, finish), name="zcore-checkpoint-writer", daemon=True
        )
        self.state = SaveState.WRITING
        self._copied.clear()
        self._thread.start()
        return job.root / job.tag

    def finish_copy(self) -> None:
        """Returns once no copy is pending in the background: the live values
        may change from here on."""
        self._copied.wait()

    def wait(self) -> None:
        """WRITING, WRITTEN or FAILED -> IDLE: the pending write finished;
        raises its failure (every rank alike). Returns at once when IDLE or CLOSED."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.state is SaveState.FAILED:
            failure, self._failure = self._failure, None
            self.state = SaveState.IDLE
            _note(failure, f"(raised by the asynchronous save of tag {self._tag!r}, written in the background)")
            raise failure
        if self.state is SaveState.WRITTEN:
            self.state = SaveState.IDLE

    def close(self) -> None:
        """Any -> CLOSED: finishes a pending write, then destroys the
        writer's group and releases the buffer; raises the write's failure
        last."""
        if self.state is SaveState.CLOSED:
            return
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():  # else torch destroyed every group
                dist.destroy_process_group(self._group)
            self._group = None
            self._buffer.close()
            _LIVE.discard(self)
            self.state = SaveState.CLOSED

    def finish_at_exit(self) -> None:
        """At interpreter exit: a pending write finishes; its failure is
        logged, as nothing is left to raise it to."""
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001
            log.error("zcore: the asynchronous checkpoint save failed at exit: %s: %s", type(exc).__name__, exc)

    def _write(self, job: SaveJob, group: Optional[dist.ProcessGroup], finish: Callable[[], None]) -> None:
        """The writer thread: the deferred copy, ``write_save``, then WRITING
        -> WRITTEN or FAILED."""
        failure = None
        try:
            copied = None
            try:
                finish()
            except Exception as exc:  # noqa: BLE001 - agreed below, on every rank
                copied = exc
            finally:
                self._copied.set()
            comm.raise_if_any_failed(copied, "copying the checkpoint to host memory", CheckpointError, group)
            write_save(job, group, show_progress=False)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by wait
            failure = exc
        finally:
            partials.release(staging_dir(job.root, job.tag))
        self._failure = failure
        self.state = SaveState.FAILED if failure is not None else SaveState.WRITTEN

    def _writer_group(self) -> Optional[dist.ProcessGroup]:
        """The writer's gloo group over every rank, made once (a collective:
        every rank makes it at the same, first, asynchronous save)."""
        if not self._group_made:
            if dist.is_initialized() and dist.get_world_size() > 1:
                self._group = dist.new_group(backend="gloo")
            self._group_made = True
        return self._group


def _note(error: BaseException, note: str) -> None:
    """Adds ``note`` to ``error``'s message where Python can (3.11+)."""
    if sys.version_info >= (3, 11):
        error.add_note(note)


_LIVE: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


def finish_copies() -> None:
    """Waits for every live engine's background copy: called by whatever
    changes settled values (optimizer steps, loads, written-back gathers)."""
    for checkpointer in list(_LIVE):
        checkpointer.finish_copy()


@atexit.register
def _finish_at_exit() -> None:
    for checkpointer in list(_LIVE):
        checkpointer.finish_at_exit()
