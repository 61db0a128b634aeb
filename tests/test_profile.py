"""Profiles: the concave, non-decreasing envelope of noisy measurements."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from powerd.profile import Profile, ProfileError, concave_envelope

points_st = st.lists(
    st.tuples(st.integers(100, 800).map(float), st.floats(0, 2, allow_nan=False)),
    min_size=1,
    max_size=12,
)


@given(points_st)
def test_envelope_is_concave_non_decreasing_and_above_every_point(
    points: list[tuple[float, float]],
) -> None:
    p = Profile.from_points("x", points)
    assert np.all(np.diff(p.power_w) > 0)
    assert np.all(np.diff(p.throughput) >= -1e-12)
    slopes = p.slopes_per_w
    assert np.all(np.diff(slopes) <= 1e-12)
    for x, y in points:
        assert p.value(x) >= y - 1e-9


def test_dip_after_peak_is_flattened_and_noise_is_hulled() -> None:
    power, tput = concave_envelope([[200, 0.3], [300, 0.5], [400, 0.9], [500, 0.95], [600, 0.9]])
    assert list(power) == [200, 400, 500]  # 300 lies under the chord; 600 is past the peak
    assert list(tput) == [0.3, 0.9, 0.95]
    p = Profile.from_points("x", [[200, 0.3], [400, 0.9], [500, 0.95], [600, 0.9]])
    assert p.value(650) == pytest.approx(0.95)
    assert p.peak_w == 500


def test_below_first_point_extends_the_first_slope_and_reports_zero_floor() -> None:
    p = Profile.from_points("x", [[200, 0.4], [400, 0.8]])
    assert p.value(100) == pytest.approx(0.2)
    assert p.value(0) == pytest.approx(0.0)


@pytest.mark.parametrize("bad", [[], [[1, 2, 3]], [[float("nan"), 1]], [[-1, 0.5]]])
def test_bad_points_are_rejected(bad: list[list[float]]) -> None:
    with pytest.raises(ProfileError):
        Profile.from_points("x", bad)
