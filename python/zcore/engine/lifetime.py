"""Whether an engine can still be used: live, broken by a failure that left
its states partly updated, or destroyed (its swap files and buffers gone)."""

from __future__ import annotations

import enum
from typing import Callable

from zcore.errors import InvalidStateError


class EngineState(enum.Enum):
    LIVE = "live"  # trains, saves and loads
    BROKEN = "broken"  # a step, forward or backward failed part-way: only a full checkpoint load recovers it
    DESTROYED = "destroyed"  # destroy() ran: nothing recovers it


class Lifetime:
    """The engine's state and the reason it broke; the one owner of both."""

    def __init__(self) -> None:
        self.state = EngineState.LIVE
        self.reason = ""  # what broke it, for the message every later call raises

    def break_because(self, reason: str) -> None:
        """A failure left parameters or optimizer states partly updated. The
        first reason stays: later failures follow from it."""
        if self.state is EngineState.LIVE:
            self.reason = reason
            self.state = EngineState.BROKEN

    def recover(self) -> None:
        """Every parameter and optimizer state was replaced (a full load)."""
        if self.state is EngineState.BROKEN:
            self.reason = ""
            self.state = EngineState.LIVE

    def destroy(self, close: Callable[[bool], None]) -> None:
        """Runs ``close(was_live)`` once, the first time; the engine is
        destroyed even when ``close`` raises."""
        if self.state is EngineState.DESTROYED:
            return
        was_live = self.state is EngineState.LIVE
        self.state = EngineState.DESTROYED
        close(was_live)

    def check_not_destroyed(self) -> None:
        if self.state is EngineState.DESTROYED:
            raise InvalidStateError(
                "this engine was destroyed: engine.destroy() removed its swap files and released its "
                "buffers. Build a new engine with zcore.initialize (and load a checkpoint to go on)"
            )

    def check_usable(self) -> None:
        """Raises unless the engine is live."""
        self.check_not_destroyed()
        if self.state is EngineState.BROKEN:
            raise InvalidStateError(
                f"this engine cannot continue: {self.reason[:2000]}, so its parameters and optimizer "
                "states are partly updated. Remove the cause, then load the last checkpoint into a "
                "new engine"
            )
