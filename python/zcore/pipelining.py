"""Pipeline parallelism under zcore: ``PipelineStage`` (public path of
zcore.parallel.pipelining)."""

from zcore.parallel.pipelining import PipelineStage

__all__ = ["PipelineStage"]

PipelineStage.__module__ = __name__
