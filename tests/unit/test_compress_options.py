"""Compressor options are declared once (``option(default, doc, check)``): each one round-trips
from the options a user writes to the compressor and back to the listing, a bad value is
refused in one line naming the compressor, the option and the value, and the "Writing a
compressor" example of docs/ARCHITECTURE.md works as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch

from gossip import compress
from gossip.cli.common import key_values
from gossip.compress import COMPRESSORS, DensitySparsifier, DensityWarmup, WrapperOptions
from gossip.compress.catalog import describe
from gossip.errors import ConfigError
from gossip.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
NAMES = COMPRESSORS.names()


def examples():
    return [(name, example) for name in NAMES
            for example in COMPRESSORS.get(name).options_class.examples]


@pytest.mark.parametrize("name, given", examples(), ids=repr)
def test_options_round_trip_from_what_a_user_writes_to_the_listing(name, given):
    listed = {row["name"]: row for row in describe()}[name]["options"]
    defaults = {row["option"]: row["default"] for row in listed}
    assert list(defaults) == compress.compressor_options(name)
    compressor = compress.build(name, **given)
    assert type(compressor) is COMPRESSORS.get(name)
    if name != "none":  # to a strategy, compressor=none means no compressor
        # Written as the CLI's --option KEY=VALUE strings (a YAML mapping reads the same).
        written = [f"compressor={name}", *(f"{key}={json.dumps(value)}"
                                           for key, value in given.items())]
        spec = key_values("--option", {}, written)
        chosen = STRATEGIES.options("dpsgd", spec).compressor
        assert chosen.options == compressor.options
    held = {spec.name: getattr(compressor.options, spec.name)
            for spec in fields(compressor.options)}
    assert held == {**defaults, **given}
    assert repr(compressor) == f"{type(compressor).__name__}(" + ", ".join(
        f"{key}={value!r}" for key, value in held.items()) + ")"
    # ... and it works with them: the payload round-trips through a fresh receiver.
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    sent = compressor.compress(x, key="w", round=2)
    assert compress.create(name).decompress(sent).shape == x.shape


def test_examples_give_every_option_a_value_other_than_its_default():
    for name in NAMES:
        options = COMPRESSORS.get(name).options_class
        changed = {key for example in options.examples for key, value in example.items()
                   if value != getattr(options(), key)}
        assert changed == set(options.names()), name


def test_the_listing_is_read_from_the_declarations():
    rows = {row["name"]: row for row in describe()}
    assert set(rows) == {*NAMES, "wrappers"}
    for name in NAMES:
        declared = fields(COMPRESSORS.get(name).options_class)
        assert rows[name]["options"] == [
            {"option": spec.name, "default": spec.default, "doc": spec.metadata["doc"]}
            for spec in declared]
        assert all(spec.default is not MISSING and spec.metadata["doc"] for spec in declared)
        assert rows[name]["doc"] and "\n" not in rows[name]["doc"]
    assert [row["option"] for row in rows["wrappers"]["options"]] == WrapperOptions.names()


class Nonsense:
    def __repr__(self) -> str:
        return "Nonsense()"


@pytest.mark.parametrize("name, key", [(name, key) for name in NAMES
                                       for key in compress.compressor_options(name)])
def test_a_bad_value_is_one_line_naming_compressor_option_and_value(name, key):
    with pytest.raises(ConfigError) as caught:
        compress.create(name, **{key: Nonsense()})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"compressor {name!r}: {key} must be ")
    assert message.endswith("got Nonsense()")


def test_the_wrappers_options_are_declared_and_checked_together():
    assert WrapperOptions.names() == ["error_feedback", "momentum", "clip_norm",
                                      "warmup_rounds", "warmup_start"]
    with pytest.raises(ConfigError, match="^warmup_rounds must be an integer, got 2.5$"):
        compress.build("topk", warmup_rounds=2.5)
    wrapped = compress.build("randomk", density=0.1, warmup_rounds=2, error_feedback=True)
    assert wrapped.inner.inner.density == 0.1


def test_density_warmup_takes_density_sparsifiers_by_type():
    assert {name for name in NAMES
            if issubclass(COMPRESSORS.get(name), DensitySparsifier)} == {"randomk", "topk"}
    topk = compress.create("topk", density=0.01, seed=3)
    warm = DensityWarmup(topk, rounds=4)
    wider = topk.with_density(0.5)
    assert (wider.density, wider.options.seed, topk.density) == (0.5, 3, 0.01)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert warm.inner.unpack(warm.compress(x, round=0)).indices.numel() == 250
    # Having ``density`` and ``with_density`` is not enough: a DensitySparsifier is needed.
    duck = compress.create("qsgd")
    duck.density, duck.with_density = 0.1, lambda density: duck
    with pytest.raises(ConfigError, match="needs a compressor with a density"):
        DensityWarmup(duck, rounds=2)


def test_only_compressor_classes_register():
    with pytest.raises(TypeError, match="register a Compressor subclass"):
        COMPRESSORS.register("made-up")(lambda **options: None)
    assert "made-up" not in COMPRESSORS


EXAMPLE_CHECK = textwrap.dedent("""
    import torch, gossip, int8_example
    from gossip import compress
    from gossip.compress.catalog import describe
    from gossip.transport import Message, codec
    assert compress.compressor_options("int8") == ["levels"]
    row = next(r for r in describe() if r["name"] == "int8")
    assert row["options"][0]["option"] == "levels" and row["options"][0]["default"] == 127
    assert row["doc"].startswith("x ≈ max|x|"), row
    x = torch.randn(4, 250, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sent = compress.create("int8", levels=100).compress(x, key="w", round=1)
    header, frames = codec.encode(Message("gossip", 1, meta=sent.meta, buffers=sent.buffers), 0)
    msg = codec.decode([header] + [bytearray(f.numpy().tobytes()) for f in frames])
    got = compress.create("int8").decompress(compress.Payload(msg.meta, msg.buffers))
    assert got.shape == x.shape and float((got - x).abs().max()) <= float(x.abs().max()) / 200
    ef = compress.build("int8", levels=7, error_feedback=True)  # what was not sent is kept
    kept = compress.create("int8").decompress(ef.compress(x, key="w"))
    assert torch.allclose(kept + ef.residual("w").view_as(x), x)
    options = gossip.STRATEGIES.options("dpsgd", {"compressor": "int8", "levels": 50})
    assert options.compressor.options.levels == 50
    try:
        compress.create("int8", levels=300)
    except gossip.ConfigError as exc:
        assert str(exc) == "compressor 'int8': levels must be in [1, 127], got 300", exc
    else:
        raise AssertionError("a bad levels was accepted")
    print("example ok")
""")


def test_the_writing_a_compressor_example_works_as_written(tmp_path):
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Writing a compressor", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    (tmp_path / "int8_example.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # A fresh interpreter: the example's registration does not leak into the other tests.
    done = subprocess.run([sys.executable, "-c", EXAMPLE_CHECK], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "example ok" in done.stdout, done.stderr[-3000:]
