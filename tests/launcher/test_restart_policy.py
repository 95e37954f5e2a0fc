"""The launcher's restart schedule: delays that double with each recent restart, and the crash-loop bound."""

from __future__ import annotations

import pytest

from flotilla.fleet.restarts import RestartHistory, RestartPolicy


def test_delays_double_until_the_bound_then_give_up():
    history = RestartHistory(RestartPolicy(max_restarts=4, window_s=60, first_delay_s=0.5))
    assert [history.after_exit(now=float(t)) for t in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert history.after_exit(now=4.0) is None  # a fifth death within the window: a crash loop
    assert history.total == 4


def test_restarts_older_than_the_window_are_forgotten():
    history = RestartHistory(RestartPolicy(max_restarts=2, window_s=10, first_delay_s=1))
    assert history.after_exit(now=0) == 1  # restarts at 1
    assert history.after_exit(now=5) == 2  # at 7
    assert history.after_exit(now=11.5) == 2  # the first left the window: one recent restart, not two
    assert history.after_exit(now=30) == 1  # all forgotten: the backoff starts over
    assert history.total == 4


def test_the_delay_is_capped():
    history = RestartHistory(RestartPolicy(max_restarts=10, window_s=1000, first_delay_s=1, max_delay_s=5))
    assert [history.after_exit(now=float(t)) for t in range(5)] == [1, 2, 4, 5, 5]


def test_no_restarts_allowed_stops_at_the_first_death():
    assert RestartHistory(RestartPolicy(max_restarts=0)).after_exit(now=0) is None


@pytest.mark.parametrize("fields", [{"max_restarts": -1}, {"window_s": 0}, {"first_delay_s": -1}])
def test_nonsense_policies_are_refused(fields):
    with pytest.raises(ValueError, match="restart policy needs"):
        RestartPolicy(**fields)
