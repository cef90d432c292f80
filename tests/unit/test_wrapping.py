"""The ``wraps`` capability: wrappers are found by it (the matrix, the experiment analysis),
never by an option's name."""

from __future__ import annotations

from gossip.strategies import STRATEGIES, Strategy
from gossip.strategies.wrapping import wrapped


def test_the_wrappers_say_so_and_nothing_else_does():
    assert sorted(STRATEGIES.where(wraps=True)) == ["local", "nonblocking"]
    assert Strategy.wraps is False


def test_a_wrappers_options_split_into_inner_and_own():
    assert wrapped("nonblocking", {}) == ("ring-allreduce", {}, {})
    given = {"inner": "dpsgd", "inner_options": {"staleness": 1}, "period": 4}
    assert wrapped("local", given) == ("dpsgd", {"staleness": 1}, {"period": 4})
    assert given == {"inner": "dpsgd", "inner_options": {"staleness": 1}, "period": 4}


def test_a_strategy_that_wraps_none_or_is_unknown_has_no_inner():
    assert wrapped("dpsgd", {"compressor": "topk"}) is None
    assert wrapped("no-such-strategy", {"inner": "dpsgd"}) is None
