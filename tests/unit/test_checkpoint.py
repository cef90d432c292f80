"""Checkpoint files: atomic writes, full round trips, clear errors; and a whole job restarted
from its checkpoints ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gossip import checkpoint
from gossip.config import TrainConfig
from gossip.errors import CheckpointError, PeerTimeout, RejoinError
from gossip.peer import Peer
from gossip.topology import Topology
from gossip.training.synchronous import train
from gossip.transport import LoopbackHub
from support import assert_same


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"rank": 1, "strategy": "dpsgd", "task": "digits", "round": 5,
            "model": {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)},
            "optimizer": {"state": {0: {"momentum_buffer": torch.randn(3, generator=g)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "strategy_state": {"residual": torch.randn(7, generator=g), "dropped": {3: 4}},
            "torch_rng": torch.get_rng_state(), "batches_drawn": 17, "lost_peers": {3: 4}}


def test_round_trip_keeps_every_tensor_and_value(tmp_path):
    path = checkpoint.path_for(tmp_path / "ckpt", 1)
    checkpoint.save(path, state())
    loaded = checkpoint.load(path, rank=1, strategy="dpsgd")
    assert loaded.pop("format") == checkpoint.FORMAT
    assert_same(loaded, state())
    assert [p.name for p in path.parent.iterdir()] == ["peer-1.pt"]  # no temporary left


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "peer-1.pt"
    checkpoint.save(path, state(0))

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")  # the new file is partly written ...
        raise OSError("disk full")     # ... when the writer dies

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, state(1))
    monkeypatch.undo()
    assert_same({k: v for k, v in checkpoint.load(path).items() if k != "format"}, state(0))
    assert [p.name for p in tmp_path.iterdir()] == ["peer-1.pt"]


@pytest.mark.parametrize("content, why", [
    (b"", "corrupt or not a checkpoint"),
    (b"not a checkpoint at all", "corrupt or not a checkpoint"),
    (None, "corrupt or not a checkpoint"),  # a real checkpoint, truncated
])
def test_a_corrupt_file_is_one_line_naming_it(tmp_path, content, why):
    path = tmp_path / "peer-0.pt"
    if content is None:
        checkpoint.save(path, state())
        content = path.read_bytes()[:200]
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    text = str(info.value)
    assert str(path) in text and why in text and "\n" not in text


def test_missing_incomplete_and_mismatched_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="peer-9.pt: no such file"):
        checkpoint.load(tmp_path / "peer-9.pt")
    path = tmp_path / "peer-1.pt"
    torch.save({"format": checkpoint.FORMAT, "rank": 1}, path)
    with pytest.raises(CheckpointError, match="is incomplete: no strategy, task, round"):
        checkpoint.load(path)
    checkpoint.save(path, state())
    with pytest.raises(CheckpointError, match="is for rank 1, this peer has rank 2"):
        checkpoint.load(path, rank=2)
    with pytest.raises(CheckpointError, match="is for strategy 'dpsgd', this peer has "
                                              "strategy 'matcha'"):
        checkpoint.load(path, strategy="matcha")


def test_all_reduce_cannot_take_one_restarted_peer_back(run_peers):
    """Rank 1 keeps running (waits in round 3); rank 0 restarts alone: refused, naming why."""
    topology = Topology.generate("ring", 2)
    hub = LoopbackHub(2)

    def main(rank: int):
        with Peer(rank, topology, "ring-allreduce", timeout=1,
                  transport=hub.transport(rank, timeout=1)) as peer:
            if rank == 1:
                with pytest.raises(PeerTimeout):  # nobody else comes
                    peer.synchronize(torch.ones(3), 3)
                return None
            with pytest.raises(RejoinError) as info:
                peer.rejoin(2)
            return str(info.value)

    message = run_peers(2, main)[0]
    assert ("RingAllReduce cannot take a restarted peer back into a running job" in message
            and "restart every peer with --resume" in message), message


@pytest.mark.parametrize("strategy, options", [
    ("dpsgd", {}),
    pytest.param("matcha", {"budget": 0.7}, marks=pytest.mark.slow),
    pytest.param("ring-allreduce", {}, marks=pytest.mark.slow),
    ("dpsgd", {"compressor": "topk", "density": 0.3}),  # CHOCO: public copies restored
    ("topk-allgather", {"density": 0.3}),  # error-feedback residuals restored
    pytest.param("matcha", {"budget": 0.7, "compressor": "topk", "density": 0.3},
                 marks=pytest.mark.slow),  # per-edge copies
], ids=["dpsgd", "matcha", "ring-allreduce", "choco", "topk-allgather", "matcha-choco"])
def test_whole_job_restarted_from_checkpoints_ends_bitwise_where_it_would_have(
        tmp_path, strategy, options, run_peers):
    """Three peers stop after round 6 and all restart from their checkpoints of round 5:
    model, momentum, data stream, RNG and strategy state are restored exactly, so rounds 5-9
    are computed again to the same bits as in an uninterrupted run."""
    topology = Topology.generate("ring", 3)
    config = TrainConfig(strategy=strategy, options=options, rounds=10, checkpoint_every=5,
                         eval_every=4, batch_size=16, timeout=10)

    def run(tag: str, *, rounds: int = 10, resume_from: str | None = None) -> list[dict]:
        hub = LoopbackHub(3)

        def main(rank: int) -> dict:
            # Compared bitwise: a gemm splits its sums by the threads it gets (scheduler-
            # dependent with several peers on two cores), so one thread each.
            torch.set_num_threads(1)
            path = checkpoint.path_for(tmp_path / tag, rank)
            if resume_from:
                path.parent.mkdir(exist_ok=True)
                path.write_bytes(checkpoint.path_for(tmp_path / resume_from, rank).read_bytes())
            with Peer(rank, topology, strategy, timeout=10,
                      transport=hub.transport(rank, timeout=10),
                      keep_for_rejoin=True, **options) as peer:
                train(peer, dataclasses.replace(config, rounds=rounds), checkpoint_path=path,
                      resume=resume_from is not None)
            return checkpoint.load(path)

        return run_peers(3, main, timeout=60)

    whole = run("whole")
    run("first", rounds=7)  # its last checkpoint is of round 5
    resumed = run("resumed", resume_from="first")
    for rank in range(3):
        assert whole[rank]["round"] == resumed[rank]["round"] == 10
        assert_same(whole[rank]["model"], resumed[rank]["model"])
        assert_same(whole[rank]["optimizer"], resumed[rank]["optimizer"])
        assert whole[rank]["batches_drawn"] == resumed[rank]["batches_drawn"]
