"""TaggedOptions: a tag option and the message kinds it names, declared with the class."""

from __future__ import annotations

import dataclasses

import pytest

from gossip.errors import ConfigError
from gossip.strategies import Strategy
from gossip.options import Options, TaggedOptions, option


@dataclasses.dataclass(frozen=True)
class PairOptions(TaggedOptions, tag="pair", kinds=("up", "down")):
    width: int = option(2, "how wide")


@dataclasses.dataclass(frozen=True)
class SingleOptions(PairOptions, tag="single", kinds=("",)):
    depth: int = option(1, "how deep")


def test_the_tag_has_its_default_a_doc_and_follows_the_own_fields():
    assert PairOptions().tag == "pair" and SingleOptions().tag == "single"
    assert PairOptions.names() == ["width", "tag"]
    assert SingleOptions.names() == ["width", "tag", "depth"]
    assert all(row["doc"] for row in SingleOptions.describe())


def test_kinds_follow_the_tag_when_retagged():
    assert PairOptions().kinds == ("pair.up", "pair.down")
    assert dataclasses.replace(PairOptions(), tag="b0").kinds == ("b0.up", "b0.down")
    assert SingleOptions(tag="x").kinds == ("x",)


def test_a_tag_is_checked_like_any_option():
    with pytest.raises(ConfigError, match="tag must be a string"):
        PairOptions(tag=3)


def test_a_strategy_has_its_options_kinds_or_says_its_own():
    class Quiet(Strategy):
        operates_on = "params"

        def synchronize(self, x, round, *, out=None):
            return x

    quiet = Quiet.__new__(Quiet)
    quiet.options = PairOptions(tag="q")
    assert quiet.kinds == ("q.up", "q.down")
    quiet.options = Options()
    with pytest.raises(ConfigError, match="Quiet: declare its options on TaggedOptions"):
        quiet.kinds
