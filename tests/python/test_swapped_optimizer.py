"""Sizing the NVMe optimizer's sub-groups (zcore.step.swapped_optimizer.sub_group_elements)."""

import pytest

from zcore.errors import ConfigError
from zcore.step.swapped_optimizer import sub_group_elements

GiB = 1 << 30
PER_ELEMENT = 4 * 12  # four buffers of fp32 master, exp_avg and exp_avg_sq


def test_by_default_the_states_are_cut_in_eighths_so_that_the_step_overlaps_its_io():
    # 46M elements (a rank's half of a 92M-parameter model), plenty of memory.
    assert sub_group_elements(46_000_000, 4, 1_000_000_000, False, 64 * GiB) == 5_750_000


def test_by_default_no_sub_group_is_below_a_million_elements_unless_the_states_are():
    assert sub_group_elements(4_000_000, 4, 1_000_000_000, False, 64 * GiB) == 1 << 20
    assert sub_group_elements(30_000, 4, 1_000_000_000, False, 64 * GiB) == 30_000


def test_by_default_the_buffers_stay_within_a_quarter_of_available_memory_and_4_gib():
    big = 10_000_000_000
    assert sub_group_elements(big, 4, 1_000_000_000, False, 64 * GiB) == (4 * GiB) // PER_ELEMENT
    assert sub_group_elements(big, 4, 1_000_000_000, False, 8 * GiB) == (2 * GiB) // PER_ELEMENT


def test_a_set_size_is_taken_as_it_is_or_refused_naming_the_size_that_fits():
    assert sub_group_elements(46_000_000, 4, 20_000_000, True, 64 * GiB) == 20_000_000
    with pytest.raises(ConfigError, match=r"set sub_group_size to at most 22369621"):
        sub_group_elements(46_000_000, 4, 40_000_000, True, GiB)
