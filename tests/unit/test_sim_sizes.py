"""Sizes-only simulation: the strategy's message pattern replayed without payloads sends the
bytes per kind a full simulation (the real strategy code, real math) sends, and its peers
finish their rounds at the same virtual times."""

from __future__ import annotations

import pytest

from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.sim import MeasuredCompute, NetworkModel, Simulation, simulate_run
from gossip.sim.sizes import simulate_sizes
from gossip.topology import Topology


SPARSE = {"indices": "int32", "density": 0.05}

@pytest.mark.slow
@pytest.mark.parametrize("strategy, peers, options, kinds", [
    ("spardl", 3, SPARSE, {"spardl.rs", "spardl.ag"}),
    ("spardl", 5, SPARSE, {"spardl.rs", "spardl.ag"}),
    ("gtopk", 5, SPARSE, {"gtopk.up", "gtopk.down"}), ("topk-allgather", 3, SPARSE, {"tkag"}),
    ("ring-allreduce", 5, {"piece_bytes": 1000}, {"ring.rs", "ring.ag"})])
def test_sizes_only_bytes_per_kind_equal_the_full_simulation(strategy, peers, options, kinds):
    config = TrainConfig.from_dict({"strategy": strategy, "rounds": 2, "batch_size": 8,
                                    "eval_every": 100, "seed": 1, "options": options,
                                    "delays": {"compute": 0.01}})
    simulation = Simulation(network=NetworkModel(rate="100mbit", latency=0.001))
    full = simulate_run(config, Topology.generate("ring", peers), "unused", simulation,
                        write=False)
    sizes = simulate_sizes(config, Topology.generate("ring", peers), simulation)
    kinds = kinds | {"start"}  # gossip/same_start.py's check before round 0, in both
    assert set(sizes.bytes_sent) == kinds
    for kind, sent in sizes.bytes_sent.items():
        assert sent == sum(stats["by_kind"][kind]["bytes_sent"]
                           for stats in full.stats.values()), kind
    assert sizes.messages == sum(stats["by_kind"][kind]["messages_sent"]
                                 for stats in full.stats.values() for kind in kinds)
    # Without the math, the same virtual times too (the last round also runs the probe).
    assert sizes.round_end[0].tolist() == pytest.approx(
        [full.records[rank][0]["time"] for rank in range(peers)], rel=1e-9)
    assert (sizes.round_end[1] > sizes.round_end[0]).all()


def test_sizes_only_refuses_what_it_cannot_replay():
    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 1})
    with pytest.raises(ConfigError, match="strategy 'dpsgd' has no traffic plan"):
        simulate_sizes(config, Topology.generate("ring", 3), Simulation())
    config = TrainConfig.from_dict({"strategy": "spardl", "rounds": 1})
    with pytest.raises(ConfigError, match="--compute measured needs the math"):
        simulate_sizes(config, Topology.generate("ring", 3), Simulation(compute=MeasuredCompute()))


def test_sizes_only_in_an_experiment_must_be_a_boolean():
    assert Simulation.from_dict({"sizes_only": True}).sizes_only
    with pytest.raises(ConfigError, match="sizes_only: expected true or false, got 'no'"):
        Simulation.from_dict({"sizes_only": "no"})


def test_cli_sizes_only_writes_a_run_the_scaling_table_reads(tmp_path):
    from click.testing import CliRunner

    from gossip.cli import main
    from gossip.sim.scaling import scaling_rows

    run = tmp_path / "exp" / "spardl-4"
    result = CliRunner().invoke(main, ["simulate", "--peers", "4", "--strategy", "spardl",
                                       "--rounds", "2", "--rate", "1gbit", "--compute-delay",
                                       "0.001", "--sizes-only", "--quiet", "--run-dir", str(run)])
    assert result.exit_code == 0, result.output
    (row,) = scaling_rows(tmp_path / "exp")
    assert (row["strategy"], row["peers"], row["point"]) == ("spardl", 4, "validated (sizes only)")
    assert row["compute_s"] == pytest.approx(0.001) and 0 < row["efficiency"] < 1
    result = CliRunner().invoke(main, ["simulate", "--peers", "3", "--strategy", "dpsgd",
                                       "--sizes-only", "--quiet", "--run-dir", str(run)])
    assert result.exit_code != 0 and "has no traffic plan" in result.output


def test_cli_simulate_takes_a_generators_parameters(tmp_path):
    from click.testing import CliRunner

    from gossip.cli import main

    run = tmp_path / "torus"
    result = CliRunner().invoke(main, ["simulate", "--graph", "torus", "--graph-option", "rows=3",
                                       "--graph-option", "cols=3", "--strategy", "spardl",
                                       "--rounds", "1", "--sizes-only", "--quiet",
                                       "--run-dir", str(run)])
    assert result.exit_code == 0, result.output
    assert "9 simulated peers, torus-9" in result.output
    torus = Topology.from_yaml(run / "topology.yaml")
    assert torus.graph.number_of_edges() == 18 and {d for _, d in torus.graph.degree()} == {4}


def test_a_sizes_only_ring_all_reduce_takes_memory_linear_in_the_peers():
    """P ranks of 2(P-1) steps each: the plans are made as they are replayed, so the replay
    holds O(P) (each rank's current step, the messages in flight), not every step at once."""
    import tracemalloc

    config = TrainConfig.from_dict({"strategy": "ring-allreduce", "rounds": 1})
    simulation = Simulation(network=NetworkModel(rate="1gbit"), sizes_only=True)
    simulate_sizes(config, Topology.generate("ring", 3), simulation)  # imports, caches

    def peak(peers: int) -> int:
        tracemalloc.start()
        try:
            result = simulate_sizes(config, Topology.generate("ring", peers), simulation)
            assert result.messages == 2 * peers * (peers - 1) + peers  # + the start check
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(31), peak(93)  # 3x the peers, 9x the steps (quadratic: 6x the peak)
    assert large < 3 * small, (small, large)


@pytest.mark.parametrize("number", [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
                                    -1, -32, -33, -128, -129, -32768, -32769, -2**31,
                                    -2**31 - 1])
def test_a_plans_message_sizes_are_the_codecs_at_every_msgpack_width(number):
    """Sizes are encoded once per shape (ints by msgpack width): still the codec's bytes."""
    import torch

    from gossip.strategies.traffic import message_bytes
    from gossip.transport import Message, codec

    for rank, meta, numel in ((abs(number), {"n": number, "s": 3, "ids": [number, 1]}, 7),
                              (5, {"n": 10, "s": number, "f": 0.5, "x": "ab"}, abs(number) % 999),
                              (number % 300, {"blocks": {"k": [number]}, "b": True}, 0)):
        tensors = (torch.empty(numel), torch.empty(3, dtype=torch.uint8))
        header, frames = codec.encode(Message(kind="k.x", round=0, meta=meta, buffers=tensors),
                                      rank)
        assert message_bytes(rank, "k.x", meta, [(torch.float32, numel), (torch.uint8, 3)]) == \
            len(header) + sum(f.numel() for f in frames)


def test_sizes_only_takes_a_parameter_count_and_dtype_instead_of_the_model():
    """A model known by its parameter count alone (workloads-sim.yaml): the ring sends
    2(P-1)/P of it per peer, in the given dtype's bytes, plus the headers."""
    config = TrainConfig.from_dict({"strategy": "ring-allreduce", "rounds": 1})
    sizes = {}
    for dtype in ("float32", "float16"):
        simulation = Simulation.from_dict({"sizes_only": True, "params": 1_000_000,
                                           "dtype": dtype, "rate": "1gbit"})
        sent = simulate_sizes(config, Topology.generate("ring", 4), simulation).bytes_sent
        sizes[dtype] = sum(sent.values())
    payload = 4 * 2 * 3 / 4 * 1_000_000  # 4 peers, 2(P-1)/P of the model each
    assert payload * 4 < sizes["float32"] < payload * 4 + 4 * 6 * 200  # + headers
    assert payload * 2 < sizes["float16"] < payload * 2 + 4 * 6 * 200
    assert Simulation.from_dict({"sizes_only": True, "params": 5}).to_dict()["params"] == 5


def test_params_and_dtype_are_checked():
    for data, culprit in (({"params": 5}, "params and dtype are for sizes_only runs"),
                          ({"sizes_only": True, "params": 0}, "params: expected a positive"),
                          ({"sizes_only": True, "dtype": "int8"}, "dtype: 'int8' is not one")):
        with pytest.raises(ConfigError, match=culprit):
            Simulation.from_dict(data).check(4)
