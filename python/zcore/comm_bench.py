"""Timing zcore's collectives from Python (public path of
zcore.observe.comm_bench; ``zcore bench-comm`` is the command)."""

from zcore.observe.comm_bench import Measurement, at_peak_fraction, measure, report

__all__ = ["Measurement", "at_peak_fraction", "measure", "report"]

for _name in __all__:
    globals()[_name].__module__ = __name__
