"""Ranks out of step: found within seconds, named, and raised on every rank.

Every data-parallel rank must make the same engine calls (forward,
backward, step) in the same order, since each call runs collectives the
others take part in. A call that raises on one rank only (a bad batch, an
error the script catches before it goes on) leaves the others waiting in
the collectives of that call, and the rank's own next call starts
collectives that nobody matches: every rank waits until the process
group's timeout. This module turns that into an error on every rank,
naming the rank whose call raised and what each was doing.

Note "ranks out of step": the check costs nothing while the ranks agree.
Each rank counts its calls (``Position``); it writes to the process group's
store only when something is wrong, and bumps one counter there
(``news``) with each write:
- a call that raises writes ``failed`` with its position and the number of
  collectives it had started;
- a collective waited for longer than a slice (zcore.comm.waits) writes
  ``waiting``, with the collective's place in the call, and ``running``
  once it returns;
- a rank that finds the ranks out of step writes ``out of step``.
A rank whose call raised is *unsettled* until its next call, which first
waits for every peer to say where it is: if every peer's call raised at
the same call, after the same collectives (an interrupted backward on
every rank, a bug every rank hits), all go on; if a peer got past that call
without failing, or waits in a collective this rank never started, this
rank raises (and says so on the store). A rank waiting in a collective
reads the store once per slice while its count changes, and raises when a
peer's failed call means that nobody will join it: the peer failed at an
earlier call than this one, or at this call before starting the
collective awaited here. A peer that is only slow never writes ``failed``,
so it is never taken for one out of step.

Calls a rank may make alone are not counted: a forward without gradients
at stages 0-2 (evaluation on one rank) starts no collective. With NCCL,
``wait()`` does not block (the host blocks later, on the device), so
waiting ranks are not watched there and say nothing: a rank whose call
raised still raises at its next call, once its patience is spent, and the
others are left to NCCL's own timeout.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import weakref
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from zcore.comm import collectives as comm
from zcore.comm import waits
from zcore.comm.topology import RankGroup
from zcore.errors import InvalidStateError

log = logging.getLogger("zcore")

FAILED, WAITING, RUNNING, OUT_OF_STEP = "failed", "waiting", "running", "out of step"
_POLL = 0.05  # seconds between two reads of the store's counter while settling
_FIX = (
    "Every rank must make the same engine calls (forward, backward, step) in the same order: when a call "
    "raises on one rank, let the error end the script on every rank (or decide on every rank alike, e.g. "
    "by all-reducing a flag, to skip the batch), then restart from the last checkpoint"
)


@dataclass(frozen=True)
class Position:
    """Where a rank is: its ``call``-th counted engine call (from 0), a
    ``phase``, at engine.micro_steps ``micro_step`` (for messages)."""

    call: int
    phase: str
    micro_step: int

    def __str__(self) -> str:
        return f"{self.phase} of micro-step {self.micro_step} (engine call {self.call})"


@dataclass(frozen=True)
class Failure:
    """A call that raised: where, after ``started`` collectives, and why."""

    at: Position
    started: int
    what: str  # "ValueError: bad batch"


@dataclass(frozen=True)
class Report:
    """What a rank writes on the store: ``state`` at ``at``; ``index``: the
    awaited collective's place in the call (``waiting``); ``failed``: the
    rank's latest call that raised, whatever it does now."""

    state: str
    at: Position
    index: int
    doing: str
    failed: Optional[Failure]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: bytes) -> Optional[Report]:
        try:
            raw = json.loads(text)
            failed = raw["failed"]
            return Report(
                raw["state"], Position(**raw["at"]), raw["index"], raw["doing"],
                None if failed is None else Failure(Position(**failed["at"]), failed["started"], failed["what"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def judge_unsettled(me: int, mine: Failure, peers: dict[int, Optional[Report]]) -> tuple[bool, Optional[str]]:
    """After rank ``me``'s call ``mine`` raised, from its peers' reports:
    (True, None): every peer's call raised there too, after as many
    collectives (go on); (False, why): out of step; (False, None): not
    known yet (a peer has not said where it is, or is behind)."""
    settled = True
    for rank, report in peers.items():
        if report is None:
            settled = False
            continue
        failed = report.failed
        if report.state == OUT_OF_STEP:
            return False, f"rank {rank} did not: it stopped out of step, {report.doing}"
        if failed is not None and failed.at.call == mine.at.call:
            if failed.at.phase != mine.at.phase or failed.started != mine.started:
                return False, (
                    f"rank {rank}'s raised at another point of that call ({failed.started} collective(s) "
                    f"started there, {mine.started} on rank {me}): {failed.what}"
                )
            continue
        settled = False
        if failed is not None and failed.at.call > mine.at.call:
            return False, f"rank {rank} went past that call without an error (its {failed.at} raised later)"
        if report.state == WAITING:
            if report.at.call > mine.at.call:
                return False, f"rank {rank} went past that call without an error: it {report.doing}"
            if report.at.call == mine.at.call and report.index > mine.started:
                return False, f"rank {rank}'s call did not raise: it {report.doing}, a collective rank {me} never started"
    return settled, None


def judge_wait(
    me: int, at: Position, index: int, settled: Optional[Position], peers: dict[int, Optional[Report]]
) -> Optional[str]:
    """While rank ``me`` waits for collective ``index`` of its call ``at``:
    why nobody will join it, or None. ``settled``: the call where this
    rank's own call raised last, and every rank's with it."""
    for rank, report in peers.items():
        failed = None if report is None else report.failed
        if failed is None or (settled is not None and failed.at.call == settled.call):
            continue
        if failed.at.call < at.call:
            return f"rank {rank}'s {failed.at} raised {failed.what}, and rank {me} went on past that call"
        if failed.at.call == at.call and failed.started < index:
            return (
                f"rank {rank}'s {failed.at} raised {failed.what} after starting {failed.started} collective(s) "
                f"of it, and rank {me} waits for collective {index} of that call"
            )
    stopped = [(rank, report) for rank, report in peers.items() if report is not None and report.state == OUT_OF_STEP]
    if stopped:
        rank, report = stopped[0]
        return f"rank {rank} stopped out of step, {report.doing}"
    return None


class _Board:
    """The reports of a data-parallel group's ranks on the process group's
    store, under keys of this engine's own (engines are made collectively,
    so the k-th engine over the same ranks has the same keys on each)."""

    _serials: dict[tuple[int, ...], Iterator[int]] = {}

    def __init__(self, ranks: list[int], me: int) -> None:
        serial = next(self._serials.setdefault(tuple(ranks), itertools.count()))
        group = zlib.crc32(",".join(map(str, ranks)).encode())
        self._prefix = f"zcore/out-of-step/{group:08x}/{serial}/"
        self.me = me
        self.peers = [r for r in ranks if r != me]
        self._store: Any = None  # the default group's, taken at the first write or read
        self._seen = -1

    def _open(self) -> Any:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def post(self, report: Report) -> None:
        store = self._open()
        store.set(f"{self._prefix}rank{self.me}", report.to_json())
        store.add(f"{self._prefix}news", 1)

    def news(self) -> bool:
        """Whether anyone wrote since the last ``read``."""
        return self._open().add(f"{self._prefix}news", 0) != self._seen

    def read(self) -> dict[int, Optional[Report]]:
        store = self._open()
        self._seen = store.add(f"{self._prefix}news", 0)
        reports: dict[int, Optional[Report]] = {}
        for rank in self.peers:
            key = f"{self._prefix}rank{rank}"
            reports[rank] = Report.from_json(store.get(key)) if store.check([key]) else None
        return reports


class EngineCalls:
    """One engine's calls, counted, and the check that the ranks make them
    in step (the module docstring). ``ranks``: the data-parallel ranks;
    ``patience``: seconds a rank whose call raised waits at its next call
    for every peer to say where it is; ``on_out_of_step(reason)``: the
    engine's method that breaks it (zcore.engine.lifetime), held weakly."""

    def __init__(
        self,
        ranks: RankGroup,
        enabled: bool,
        patience: float,
        on_out_of_step: Callable[[str], None],
    ) -> None:
        self._board: Optional[_Board] = None
        if enabled and ranks.size > 1:
            everyone = list(range(ranks.size)) if ranks.group is None else dist.get_process_group_ranks(ranks.group)
            self._board = _Board(everyone, dist.get_rank())
        self._watches = self._board is not None and comm.on_gloo()  # note NCCL in the module docstring
        self._patience = patience
        self._on_out_of_step = weakref.WeakMethod(on_out_of_step)  # the engine's: it owns this object
        self._calls = 0  # counted calls made
        self._at = Position(-1, "start", 0)  # the call running (or the last one)
        self._start = comm.issued()  # collectives started before it
        self._unsettled: Optional[Failure] = None  # this rank's call that raised, not yet settled
        self._last_failure: Optional[Failure] = None
        self._settled: Optional[Position] = None  # the last call that raised on every rank alike
        self._verdict: Optional[str] = None  # why the ranks are out of step, once they are
        self._reported: Optional[int] = None  # the collective a ``waiting`` report is out for
        self._lock = threading.Lock()  # waits on autograd's and the step's threads ask too

    # The engine's side.
    @contextmanager
    def call(self, phase: str, micro_step: int, counted: bool = True) -> Iterator[None]:
        """Around one engine call: settles the previous call that raised,
        counts this one, and reports it if it raises."""
        if self._board is None or not counted:
            yield
            return
        self.settle()
        self._at = Position(self._calls, phase, micro_step)
        self._calls += 1
        self._start = comm.issued()
        if self._watches:
            waits.watch(self)
        try:
            yield
        except BaseException as exc:
            self._failed(exc)
            raise

    def settle(self) -> None:
        """Before a collective call of a rank whose previous call raised:
        returns once every peer's call raised there too; raises where the
        ranks are out of step, or where a peer has not said where it is
        within the patience."""
        if self._verdict is not None:
            raise self._error()
        mine = self._unsettled
        if mine is None:
            return
        if self._board is None:  # the store failed: nothing to settle with
            self._unsettled = None
            return
        me = self._board.me
        raised = f"rank {me}'s {mine.at} raised {mine.what}"
        where = f"after its {mine.at} raised {mine.what}"
        deadline = time.monotonic() + self._patience
        while True:
            try:
                with self._lock:
                    peers = self._board.read()
            except Exception as exc:  # noqa: BLE001 - the store went with the rank that held it
                self._out_of_step(
                    f"{raised}, and the process group's store cannot tell whether every rank's did "
                    f"({type(exc).__name__}: {exc}): a rank has ended",
                    where,
                )
            settled, why = judge_unsettled(me, mine, peers)
            if settled:
                self._unsettled, self._settled = None, mine.at
                return
            if why is not None:
                self._out_of_step(f"{raised}, but {why}", where)
            if time.monotonic() > deadline:
                silent = [
                    r for r, report in peers.items()
                    if report is None or report.failed is None or report.failed.at != mine.at
                ]
                self._out_of_step(
                    f"{raised}, and rank(s) {silent} did not say within {self._patience:g} s whether theirs "
                    "raised too (they run outside zcore's collectives, or wait in someone else's)",
                    where,
                )
            while time.monotonic() <= deadline and not self._news():
                time.sleep(_POLL)

    def _news(self) -> bool:
        try:
            return self._board.news()
        except Exception:  # noqa: BLE001 - the next read says what became of the store
            return True

    def close(self) -> None:
        if waits.watching() is self:
            waits.watch(None)

    @property
    def checks(self) -> bool:
        """Whether this engine checks that the ranks are in step (config
        out_of_step_check, more than one data-parallel rank, a store that works)."""
        return self._board is not None

    @property
    def out_of_step(self) -> Optional[str]:
        """Why the ranks are out of step, once this rank found they are."""
        return self._verdict

    # The waits' side (zcore.comm.waits.Watcher).
    def before_wait(self) -> None:
        if self._verdict is not None:
            raise self._error()

    def still_waiting(self, seq: int, kind: str, seconds: float) -> None:
        index = seq - self._start
        with self._lock:
            if self._board is None:
                return
            try:
                if self._reported != seq:
                    self._reported = seq
                    doing = f"waits in collective {index} ({kind}) of its {self._at}"
                    self._board.post(Report(WAITING, self._at, index, doing, self._last_failure))
                elif not self._board.news():
                    return
                me = self._board.me
                why = judge_wait(me, self._at, index, self._settled, self._board.read())
            except Exception as exc:  # noqa: BLE001 - without the store the wait goes on as before
                self._lose_store(exc)
                return
        if why is not None:
            where = f"waiting in collective {index} ({kind}) of its {self._at}"
            self._out_of_step(f"{why}; rank {me} waited {seconds:g} s for it in collective {index} ({kind}) of "
                              f"its {self._at}", where)

    def wait_ended(self, seq: int) -> None:
        with self._lock:
            if self._reported == seq and self._board is not None:
                self._reported = None
                self._post(Report(RUNNING, self._at, 0, f"runs its {self._at}", self._last_failure))

    # Within.
    def _failed(self, exc: BaseException) -> None:
        if self._verdict is not None:
            return  # the error is the verdict's
        what = f"{type(exc).__name__} ({str(exc)[:300]})"
        failure = Failure(self._at, comm.issued() - self._start, what)
        self._unsettled = self._last_failure = failure
        with self._lock:
            if self._board is not None:
                self._post(Report(FAILED, self._at, 0, f"raised {what} in its {self._at}", failure))

    def _post(self, report: Report) -> None:
        try:
            self._board.post(report)
        except Exception as exc:  # noqa: BLE001 - a store that fails only costs the check
            self._lose_store(exc)

    def _lose_store(self, exc: Exception) -> None:
        log.warning(
            "zcore: the process group's store fails (%s: %s); ranks out of step are no longer detected",
            type(exc).__name__, exc,
        )
        self._board = None
        if waits.watching() is self:
            waits.watch(None)

    def _out_of_step(self, why: str, where: str) -> None:
        """Raises, on this rank and from now on, that the ranks are out of
        step (``why``), and tells the others, saying ``where`` this rank was."""
        self._verdict = f"ranks out of step: {why}"
        with self._lock:
            if self._board is not None:
                self._post(Report(OUT_OF_STEP, self._at, 0, where, self._last_failure))
        breaks = self._on_out_of_step()
        if breaks is not None:
            breaks(self._verdict)
        raise self._error()

    def _error(self) -> InvalidStateError:
        return InvalidStateError(f"{self._verdict}. {_FIX}", rank=dist.get_rank(), at=str(self._at))
