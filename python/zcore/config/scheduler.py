"""The scheduler section of zcore's config: DeepSpeed's learning-rate
schedules by their type names, with DeepSpeed's params and defaults. The
schedules themselves are in zcore.optim.lr_schedules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag

from zcore.config.section import Section


class WarmupLRParams(Section):
    warmup_min_lr: float = 0.0
    # None: the optimizer's lr (DeepSpeed's WarmupLR default).
    warmup_max_lr: Optional[float] = None
    warmup_num_steps: int = Field(1000, gt=0)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


class WarmupDecayLRParams(WarmupLRParams):
    warmup_max_lr: Optional[float] = 0.001
    total_num_steps: int = Field(gt=0)


class WarmupCosineLRParams(Section):
    total_num_steps: int = Field(gt=0)
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = Field(1000, gt=0)
    cos_min_ratio: float = 0.0001
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


class OneCycleParams(Section):
    cycle_min_lr: float
    cycle_max_lr: float
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = Field(2000, gt=0)
    # None: cycle_first_step_size.
    cycle_second_step_size: Optional[int] = Field(None, ge=0)
    # 0 or less: the half moves every step (DeepSpeed's own command-line
    # defaults write -1).
    cycle_first_stair_count: int = 0
    # None: cycle_first_stair_count.
    cycle_second_stair_count: Optional[int] = None
    # 0: no decay after the cycle. DeepSpeed takes a negative size too, which
    # turns the decay into growth; zcore refuses it.
    decay_step_size: int = Field(0, ge=0)
    cycle_momentum: bool = True
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0
    last_batch_iteration: int = -1


class LRRangeTestParams(Section):
    lr_range_test_min_lr: float = 0.001
    lr_range_test_step_size: int = Field(2000, gt=0)
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False
    last_batch_iteration: int = -1


class WarmupLRScheduler(Section):
    type: Literal["WarmupLR"]
    params: WarmupLRParams = WarmupLRParams()


class WarmupDecayLRScheduler(Section):
    type: Literal["WarmupDecayLR"]
    params: WarmupDecayLRParams


class WarmupCosineLRScheduler(Section):
    type: Literal["WarmupCosineLR"]
    params: WarmupCosineLRParams


class OneCycleScheduler(Section):
    type: Literal["OneCycle"]
    params: OneCycleParams


class LRRangeTestScheduler(Section):
    type: Literal["LRRangeTest"]
    params: LRRangeTestParams = LRRangeTestParams()


def _scheduler_type(raw: Any) -> Optional[str]:
    tag = raw.get("type") if isinstance(raw, dict) else getattr(raw, "type", None)
    return tag if isinstance(tag, str) else None


# A callable discriminator with its own message: pydantic's default message
# embeds repr() of the type's value, which fails (as an unraisable warning)
# for a value nested past the recursion limit and echoes a long string whole.
SchedulerConfig = Annotated[
    Union[
        Annotated[WarmupLRScheduler, Tag("WarmupLR")],
        Annotated[WarmupDecayLRScheduler, Tag("WarmupDecayLR")],
        Annotated[WarmupCosineLRScheduler, Tag("WarmupCosineLR")],
        Annotated[OneCycleScheduler, Tag("OneCycle")],
        Annotated[LRRangeTestScheduler, Tag("LRRangeTest")],
    ],
    Discriminator(
        _scheduler_type,
        custom_error_type="scheduler_type",
        custom_error_message=(
            "expected a section whose type is 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR', 'OneCycle' "
            "or 'LRRangeTest'"
        ),
    ),
]
