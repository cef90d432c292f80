"""DiLoCo (``local`` with an outer optimizer) and streaming DiLoCo (``fragments``) against
oracles: the defaults are today's local SGD bitwise, the sign of the pseudo-gradient, the
outer Nesterov step by hand, G and its momentum equal on every peer, the inner optimizer's
state per peer, one all-reduce per period, BatchNorm buffers averaged, checkpoints."""

from __future__ import annotations

import pytest
import torch

from gossip.errors import ConfigError
from gossip.peer import Peer
from gossip.strategies import STRATEGIES
from gossip.transport import LoopbackHub
from support import BatchNormNet, run_in_threads, run_training_steps

TIMEOUT = 10.0
DILOCO = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}


def _synchronize(topology, inputs, *, states=None, load=None, **options):
    """Each rank synchronizes ``inputs[i][rank]`` with ``local`` over loopback in rounds
    ``first + i``; returns the results ``[i][rank]`` and each rank's bytes sent per round,
    the strategy states after each round into ``states[i][rank]``. ``load[rank]``: a
    strategy state to start from."""
    size, rounds = topology.size, len(inputs)
    hub = LoopbackHub(size)
    results = [[None] * size for _ in range(rounds)]
    sent = [[0] * rounds for _ in range(size)]
    first = options.pop("first", 0)

    def main(rank: int) -> None:
        with Peer(rank, topology, "local", transport=hub.transport(rank, timeout=TIMEOUT),
                  **options) as peer:
            if load is not None:
                peer.load_strategy_state(load[rank])
            for i in range(rounds):
                before = peer.stats["bytes_sent"]
                results[i][rank] = peer.synchronize(inputs[i][rank], first + i)
                sent[rank][i] = peer.stats["bytes_sent"] - before
                if states is not None:
                    states[i][rank] = peer.strategy_state()

    run_in_threads(size, main, timeout=3 * TIMEOUT)
    return results, sent


def _nesterov(g, delta, velocity, lr=0.7, momentum=0.9):
    """The outer step written out (float64): torch.optim.SGD's Nesterov update."""
    velocity = momentum * velocity + delta
    return g - lr * (delta + momentum * velocity), velocity


def test_defaults_are_local_sgd_bitwise_and_keep_no_outer_state(local_topology):
    topology = local_topology("ring", 3)
    plain = run_training_steps(topology, "local", steps=4, loopback=True, period=2)
    given = run_training_steps(topology, "local", steps=4, loopback=True, period=2,
                               outer_lr=1.0, outer_momentum=0.0, nesterov=False, fragments=1)
    assert torch.equal(plain.after, given.after)
    for rank in range(3):  # after an average (period 2: step 1) every peer holds one model
        assert torch.equal(plain.after[1, rank], plain.after[1, 0])
    strategy = STRATEGIES.create("local", rank=0, topology=topology, transport=None,
                                 options={"period": 2})
    assert strategy.outer is None and "outer" not in strategy.state_dict()


def test_outer_lr_one_with_no_momentum_is_allclose_to_local_sgd(local_topology):
    """Through the pseudo-gradient (a momentum too small to matter turns the outer step on):
    G - (G - mean theta) is the mean up to rounding."""
    topology = local_topology("ring", 5)
    plain = run_training_steps(topology, "local", steps=6, loopback=True, period=2)
    outer = run_training_steps(topology, "local", steps=6, loopback=True, period=2,
                               outer_lr=1.0, outer_momentum=1e-12)
    torch.testing.assert_close(outer.after, plain.after, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_one_peer_every_step_is_plain_sgd_the_sign(momentum, local_topology):
    """P = 1, H = 1, inner SGD at lr 0.1, outer lr 0.5: each step after the first (a plain
    average that starts G) moves by -0.5 * 0.1 * g, with the outer momentum a heavy ball on
    those steps. The wrong sign (local - global) would move uphill."""
    steps = run_training_steps(local_topology("ring", 1), "local", steps=5, loopback=True,
                               lr=0.1, period=1, outer_lr=0.5, outer_momentum=momentum)
    torch.testing.assert_close(steps.after[0], steps.before[0] - 0.1 * steps.grads[0])
    velocity = torch.zeros_like(steps.grads[0])
    for t in range(1, 5):
        velocity = momentum * velocity + 0.1 * steps.grads[t]
        torch.testing.assert_close(steps.after[t], steps.before[t] - 0.5 * velocity)


@pytest.mark.parametrize("size", [3, 5])
def test_outer_nesterov_step_by_hand_and_equal_state_on_every_peer(size, local_topology):
    """H = 1 on hand-picked vectors: round 0 starts G = [1, 2] (their mean); the mean
    pseudo-gradients are then [0.5, -1] and [0.1, 0.2]. By hand, lr 0.7, momentum 0.9:
    v = [0.5, -1], G = [1, 2] - 0.7 [0.95, -1.9] = [0.335, 3.33];
    v = [0.55, -0.7], G = [0.335, 3.33] - 0.7 [0.595, -0.43] = [-0.0815, 3.631]."""
    topology = local_topology("ring", size)
    spread = [torch.tensor([1.0, -1.0], dtype=torch.float64) * (r - (size - 1) / 2)
              for r in range(size)]
    means = [torch.tensor(m, dtype=torch.float64)
             for m in ([1.0, 2.0], [0.5, 3.0], [0.235, 3.13])]
    inputs = [[m + s for s in spread] for m in means]
    states = [[None] * size for _ in range(3)]
    results, _ = _synchronize(topology, inputs, states=states, period=1, **DILOCO)
    expected = [[1.0, 2.0], [0.335, 3.33], [-0.0815, 3.631]]
    velocities = [None, [0.5, -1.0], [0.55, -0.7]]
    for i in range(3):
        for rank in range(size):
            assert torch.equal(results[i][rank], results[i][0])
            outer = states[i][rank]["outer"]
            assert torch.equal(outer["global_model"], states[i][0]["outer"]["global_model"])
            assert torch.equal(outer["velocity"], states[i][0]["outer"]["velocity"])
        torch.testing.assert_close(results[i][0], torch.tensor(expected[i],
                                                               dtype=torch.float64))
        if velocities[i] is not None:
            torch.testing.assert_close(states[i][0]["outer"]["velocity"],
                                       torch.tensor(velocities[i], dtype=torch.float64))


def _train(topology, rounds: int, *, model_fn, **options):
    """Each rank trains ``model_fn()`` with Adam on its own data through ``Peer.step``;
    per round and rank: parameters, float buffers (and this peer's own before the step),
    Adam's first moments, the strategy state and the bytes sent."""
    size = topology.size
    hub = LoopbackHub(size)
    seen = [[None] * size for _ in range(rounds)]

    def main(rank: int) -> None:
        model = model_fn()  # from one generator of its own: threads share torch's
        init = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=init))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(10 + rank)
        with Peer(rank, topology, "local", transport=hub.transport(rank, timeout=TIMEOUT),
                  **options) as peer:
            for i in range(rounds):
                optimizer.zero_grad()
                x = torch.randn(8, 4, generator=data) * (rank + 1)
                model(x).pow(2).mean().backward()
                own = [b.clone() for b in model.buffers() if b.is_floating_point()]
                before = peer.stats["bytes_sent"]
                peer.step(model, optimizer)
                seen[i][rank] = {
                    "params": torch.cat([p.detach().reshape(-1).clone()
                                         for p in model.parameters()]),
                    "own_buffers": own,
                    "buffers": [b.clone() for b in model.buffers() if b.is_floating_point()],
                    "moments": torch.cat([optimizer.state[p]["exp_avg"].reshape(-1).clone()
                                          for p in model.parameters()]),
                    "state": peer.strategy_state(),
                    "sent": peer.stats["bytes_sent"] - before}

    run_in_threads(size, main, timeout=3 * TIMEOUT)
    return seen


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


@pytest.mark.parametrize("size", [3, 5])
def test_training_keeps_g_and_momentum_equal_and_adam_state_per_peer(size, local_topology):
    seen = _train(local_topology("ring", size), 9, model_fn=_mlp, period=3, **DILOCO)
    for i, row in enumerate(seen):
        if i % 3 == 2:  # an average: one model, G and velocity bitwise the same everywhere
            for one in row:
                assert torch.equal(one["params"], row[0]["params"])
                for key in ("global_model", "velocity"):
                    assert torch.equal(one["state"]["outer"][key], row[0]["state"]["outer"][key])
            # Adam's moments are never averaged: each peer's own data left its own
            assert len({tuple(one["moments"].tolist()) for one in row}) == size
        else:
            assert len({tuple(one["params"].tolist()) for one in row}) == size
    g = seen[-1][0]["state"]["outer"]["global_model"]
    assert g.dtype == torch.float32 and torch.equal(g, seen[-1][0]["params"])


def test_one_all_reduce_per_period_and_a_fragment_per_period_over_k(local_topology):
    """Bytes only in averaging rounds: one ring all-reduce of the vector per period H, and
    with K fragments one of a K-th of them every H/K rounds, in turn."""
    topology = local_topology("ring", 3)
    numel = sum(p.numel() for p in _mlp().parameters())  # 31

    def ring_bytes(n: int) -> list[int]:
        hub, sent = LoopbackHub(3), [0] * 3

        def main(rank):
            with Peer(rank, topology, "ring-allreduce",
                      transport=hub.transport(rank, timeout=TIMEOUT)) as peer:
                peer.synchronize(torch.ones(n), 0)
                sent[rank] = peer.stats["bytes_sent"]

        run_in_threads(3, main, timeout=3 * TIMEOUT)
        return sent

    whole, first, second = ring_bytes(numel), ring_bytes(numel // 2), ring_bytes(numel - numel // 2)
    seen = _train(topology, 8, model_fn=_mlp, period=4, **DILOCO)
    streamed = _train(topology, 8, model_fn=_mlp, period=4, fragments=2, **DILOCO)
    for rank in range(3):
        assert [row[rank]["sent"] for row in seen] == [0, 0, 0, whole[rank]] * 2
        assert [row[rank]["sent"] for row in streamed] == [0, first[rank], 0, second[rank]] * 2


def test_streaming_averages_each_fragment_in_turn_as_diloco_on_it(local_topology):
    """K = 2, H = 2, P = 3 on vectors of 5: round 0 averages the slice [0, 2) (plainly:
    G starts), round 1 the slice [2, 5), round 2 steps G on [0, 2) by the mean
    pseudo-gradient; the other slice stays each peer's own. K = 1 is DiLoCo."""
    topology = local_topology("ring", 3)
    inputs = [[torch.arange(5, dtype=torch.float64) * (r + 1) + i for r in range(3)]
              for i in range(4)]
    results, _ = _synchronize(topology, inputs, period=2, fragments=2, **DILOCO)
    mean = [torch.stack(row).mean(0) for row in inputs]
    for r in range(3):
        torch.testing.assert_close(results[0][r][:2], mean[0][:2])
        assert torch.equal(results[0][r][2:], inputs[0][r][2:])
        torch.testing.assert_close(results[1][r][2:], mean[1][2:])
        assert torch.equal(results[1][r][:2], inputs[1][r][:2])
        g, _ = _nesterov(mean[0][:2], mean[0][:2] - mean[2][:2], torch.zeros(2))
        torch.testing.assert_close(results[2][r][:2], g)
        assert torch.equal(results[2][r][2:], inputs[2][r][2:])
    one, _ = _synchronize(topology, inputs, period=1, fragments=1, **DILOCO)
    diloco, _ = _synchronize(topology, inputs, period=1, **DILOCO)
    assert all(torch.equal(a, b) for x, y in zip(one, diloco) for a, b in zip(x, y))


def test_batchnorm_buffers_are_averaged_not_stepped(local_topology):
    """The running statistics are not in the pseudo-gradient: after an average they are the
    peers' plain mean, while the parameters are G after its outer step (G holds no
    buffers)."""
    seen = _train(local_topology("ring", 3), 4, model_fn=lambda: BatchNormNet(4, 3), period=2,
                  **DILOCO)
    for i in (1, 3):
        for one in seen[i]:
            for k, buffer in enumerate(one["buffers"]):
                mean = torch.stack([o["own_buffers"][k] for o in seen[i]]).mean(0)
                torch.testing.assert_close(buffer, mean)
                assert torch.equal(buffer, seen[i][0]["buffers"][k])
            assert torch.equal(one["params"], one["state"]["outer"]["global_model"])
    assert seen[3][0]["state"]["outer"]["velocity"].abs().sum() > 0  # it stepped
    parameters = sum(p.numel() for p in BatchNormNet(4, 3).parameters())
    assert seen[3][0]["state"]["outer"]["global_model"].numel() == parameters


def test_checkpoint_round_trip_continues_bitwise(local_topology):
    topology = local_topology("ring", 3)
    inputs = [[torch.arange(6, dtype=torch.float32) * (r + 1) + i * (r - 1) for r in range(3)]
              for i in range(6)]
    states = [[None] * 3 for _ in range(6)]
    whole, _ = _synchronize(topology, inputs, states=states, period=2, fragments=2, **DILOCO)
    resumed, _ = _synchronize(topology, inputs[3:], load=states[2], first=3, period=2,
                              fragments=2, **DILOCO)
    for i in range(3):
        for r in range(3):
            assert torch.equal(resumed[i][r], whole[3 + i][r]), (i, r)
    assert states[2][0]["outer"]["started"] == [True, True]


@pytest.mark.parametrize("options, match", [
    ({"inner": "dpsgd", "outer_lr": 0.7}, "need an inner strategy that returns the exact mean"),
    ({"outer_momentum": 0.9, "optimizer_state": "average"}, "stays per peer"),
    ({"nesterov": True}, "nesterov needs an outer_momentum"),
    ({"period": 4, "fragments": 3}, "fragments must divide period"),
    ({"outer_momentum": 1.0}, "outer_momentum must be in"),
    ({"outer_lr": 0.0}, "outer_lr must be a positive"),
])
def test_refusals_are_one_line(options, match):
    with pytest.raises(ConfigError, match=match) as info:
        STRATEGIES.options("local", options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_parameter_server_inner_gives_the_ring_s_outer_steps(fragments, local_topology):
    """ps (sync) returns the exact mean too, and takes the fragments' lengths in turn."""
    topology = local_topology("ring", 3)
    inputs = [[torch.arange(7, dtype=torch.float64) * (r + 1) - i * r for r in range(3)]
              for i in range(6)]
    ring, _ = _synchronize(topology, inputs, period=2, fragments=fragments, **DILOCO)
    ps, _ = _synchronize(topology, inputs, inner="ps", period=2, fragments=fragments,
                         **DILOCO)
    for i in range(6):
        for r in range(3):
            torch.testing.assert_close(ps[i][r], ring[i][r])
            if fragments == 1 and i % 2:  # an average of the whole vector
                assert torch.equal(ps[i][r], ps[i][0])
