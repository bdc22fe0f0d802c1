"""The engine users hold: ``zcore.initialize`` assembles it from the parts
below it; it runs forward, backward and step, checkpoints and reports."""

from zcore.engine.engine import Engine

__all__ = ["Engine"]
