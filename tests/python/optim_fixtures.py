"""Fixtures shared by the optimizer-kernel tests."""

from __future__ import annotations

import pytest

import zcore.optim as zo


@pytest.fixture(params=zo.supported_cpu_isas())
def isa(request: pytest.FixtureRequest):
    """Runs the test once per SIMD level this CPU supports, then restores the level."""
    before = zo.cpu_isa()
    zo.set_cpu_isa(request.param)
    yield request.param
    zo.set_cpu_isa(before)
