"""The local-step side by side: it times both sides on the same batches, and says in one
line when decentralizepy is missing."""

from __future__ import annotations

import sys
import types

import pytest

from gossip.bench import local_step
from gossip.errors import ConfigError


def _fake_decentralizepy(monkeypatch, calls):
    """decentralizepy's Training, as far as the bench uses it: trainstep on one batch."""

    class Training:
        def __init__(self, rank, machine_id, mapping, model, optimizer, loss, log_dir,
                     batch_size=""):
            self.model, self.optimizer, self.loss = model, optimizer, loss

        def trainstep(self, data, target):
            calls.append(len(data))
            self.model.zero_grad()
            loss = self.loss(self.model(data), target)
            loss.backward()
            self.optimizer.step()
            return loss.item()

    for name in ("decentralizepy", "decentralizepy.training"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("decentralizepy.training.Training")
    module.Training = Training
    monkeypatch.setitem(sys.modules, "decentralizepy.training.Training", module)


def test_both_sides_are_timed_in_alternating_blocks(monkeypatch):
    calls = []
    _fake_decentralizepy(monkeypatch, calls)
    times = local_step.side_by_side("digits", batch=8, blocks=2, steps=3, warmup=1)
    assert [len(times[k]) for k in ("ours", "theirs", "record")] == [2, 2, 2]
    assert all(t > 0 for t in times["ours"] + times["theirs"])
    assert calls == [8] * (1 + 2 * 3)  # the same batch size on their side


def test_without_decentralizepy_one_line_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "decentralizepy.training.Training", None)
    with pytest.raises(ConfigError, match="decentralizepy is not installed"):
        local_step.side_by_side("digits", batch=8, blocks=1, steps=1, warmup=0)
    with pytest.raises(SystemExit, match="^error: decentralizepy is not installed"):
        local_step.main(["--task", "digits", "--blocks", "1", "--steps", "1"])
