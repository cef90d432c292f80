"""Robust mixing (dpsgd's ``robust`` option) between real peers over ZeroMQ on loopback, each
a thread; faulty or malicious neighbours are bare transports sending whatever payload they
like under valid headers (shared/specs/robust.md section 4)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from gossip.compress import create
from gossip.strategies import STRATEGIES
from gossip.transport import Message
from support import run_on_transports

NUMEL = 11


def test_an_infinite_radius_is_dpsgd_bit_for_bit(local_topology, run_rounds, make_data):
    topology = local_topology("exponential", 8)
    data = make_data(3, topology.size, (NUMEL,), torch.float32, seed=2)
    plain = run_rounds(topology, "dpsgd", data).results
    clipped = run_rounds(topology, "dpsgd", data, robust="clip", tau=math.inf).results
    assert torch.equal(plain, clipped)


def test_a_common_radius_without_attackers_keeps_the_honest_mean(local_topology, run_rounds,
                                                                  make_data):
    topology = local_topology("ring", 5)
    data = make_data(2, topology.size, (NUMEL,), torch.float64, seed=3) * 5
    plain = run_rounds(topology, "dpsgd", data).results
    run = run_rounds(topology, "dpsgd", data, robust="clip", tau=1.0)
    assert not torch.equal(run.results, plain)  # some differences were clipped
    torch.testing.assert_close(run.results.mean(dim=1), data.mean(dim=1), rtol=1e-12,
                               atol=1e-12)


Payload = Callable[[int, int, torch.Tensor], torch.Tensor]  # (round, dst, honest x) -> sent


def run_with_attackers(topology, options: dict, data: torch.Tensor,
                       attackers: dict[int, Payload]) -> tuple[torch.Tensor, list]:
    """Every honest rank runs dpsgd with ``options`` on ``data[round, rank]``; each rank in
    ``attackers`` sends, to each neighbour and round, what its function makes of the round's
    honest data. Returns results[round, rank] (NaN for attackers) and the honest strategies."""
    n_rounds, size = data.shape[:2]
    results = torch.full_like(data, math.nan)
    strategies: list = [None] * size

    def setup(rank: int, transport) -> None:
        if rank not in attackers:
            strategy = STRATEGIES.create("dpsgd", rank=rank, topology=topology,
                                         transport=transport, options=options)
            strategies[rank] = strategy
            # As Peer does: robust mixing takes non-finite models and leaves them out.
            transport.accept_kinds(strategy.kinds,
                                   receiver_checks_finite=strategy.checks_own_result)

    def work(rank: int, transport) -> None:
        if rank in attackers:
            for round in range(n_rounds):
                for j in topology.neighbors(rank):
                    payload = attackers[rank](round, j, data[round]).contiguous()
                    transport.send(j, message(payload, round, options))
        else:
            for round in range(n_rounds):
                results[round, rank] = strategies[rank].synchronize(
                    data[round, rank].clone(), round)

    run_on_transports(topology, setup, work)
    return results, strategies


def message(payload: torch.Tensor, round: int, options: dict) -> Message:
    """The message carrying ``payload``: as it is, or as a CHOCO difference compressed by
    the compressor the honest peers run."""
    if "compressor" not in options:
        return Message(kind="gossip", round=round, meta={"n": NUMEL}, buffers=(payload,))
    packed = create(options["compressor"], density=options["density"]).compress(
        payload, key="gossip", round=round)
    return Message(kind="gossip", round=round, meta=dict(packed.meta), buffers=packed.buffers)


PAYLOADS = {"nan": lambda r, j, x: torch.full((NUMEL,), math.nan),
            "+1e38": lambda r, j, x: torch.full((NUMEL,), 1e38),
            "-1e38": lambda r, j, x: torch.full((NUMEL,), -1e38),
            "inf": lambda r, j, x: torch.full((NUMEL,), math.inf),
            "per-neighbour": lambda r, j, x: torch.full((NUMEL,), (-1.0) ** j * 3e37 * (r + 1)),
            "sign-flip": lambda r, j, x: -100 * x[j]}


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_any_payload_on_every_neighbour_moves_a_peer_at_most_its_clipped_weight(
        payload, local_topology, make_data):
    """Rank 0 of a star: every neighbour lies; each round x_0 moves by at most
    (1 - w_00) tau."""
    topology = local_topology("star", 4)
    data = make_data(3, 4, (NUMEL,), torch.float32, seed=4)
    attack = PAYLOADS[payload]
    results, strategies = run_with_attackers(topology, {"robust": "clip", "tau": 0.5}, data,
                                             {r: attack for r in (1, 2, 3)})
    bound = (1 - strategies[0].mixing.self_weight) * 0.5
    for round in range(3):
        moved = torch.linalg.vector_norm(results[round, 0].double() - data[round, 0].double())
        assert float(moved) <= bound * (1 + 1e-5)
    fields = strategies[0].record_fields(2)
    assert fields["robust_flagged"] == (3 if payload in ("nan", "inf") else 0)
    assert fields["robust_share"] == 1.0


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_the_second_largest_radius_holds_one_liar_to_an_honest_distance(
        payload, local_topology, make_data):
    """Rank 0 of a star with two honest leaves and one liar: the liar's difference is
    clipped to at most the farther honest one's, so x_0 moves at most (1 - w_00) times it."""
    topology = local_topology("star", 4)
    data = make_data(2, 4, (NUMEL,), torch.float32, seed=6)
    results, strategies = run_with_attackers(topology, {"robust": "clip",
                                                        "tau_rule": "second"}, data,
                                             {3: PAYLOADS[payload]})
    bound = 1 - strategies[0].mixing.self_weight
    for round in range(2):
        own = data[round, 0].double()
        farthest = max(float(torch.linalg.vector_norm(data[round, j].double() - own))
                       for j in (1, 2))
        moved = torch.linalg.vector_norm(results[round, 0].double() - own)
        assert float(moved) <= bound * farthest * (1 + 1e-5)


@pytest.mark.parametrize("payload", ["nan", "+1e38", "-1e38", "per-neighbour", "sign-flip"])
def test_trimming_as_many_as_attack_stays_in_the_honest_range(payload, local_topology,
                                                              make_data):
    """Complete graph of 7, two liars; honest peers trim 2 (and take the median): every
    honest result lies inside the honest inputs' per-coordinate range."""
    topology = local_topology("complete", 7)
    data = make_data(2, 7, (NUMEL,), torch.float64, seed=5)
    attack = PAYLOADS[payload]
    liars = {5: attack, 6: attack}
    for options in ({"robust": "trimmed-mean", "trim": 2}, {"robust": "median"}):
        results, strategies = run_with_attackers(topology, options, data, liars)
        for round in range(2):
            honest = data[round, :5]
            low, high = honest.min(dim=0).values, honest.max(dim=0).values
            out = results[round, :5]
            assert ((low <= out) & (out <= high)).all(), (options, round)
        assert 0 < strategies[0].record_fields(1)["robust_share"] <= 1


def test_matcha_clips_its_partners_differences(local_topology, run_rounds, make_data):
    """matcha with robust=clip: an infinite radius is matcha bit for bit; a common one keeps
    the peers' mean (each active pair clips the same difference, opposite signs)."""
    topology = local_topology("exponential", 8)
    data = make_data(3, topology.size, (NUMEL,), torch.float64, seed=7) * 5
    options = {"budget": 0.8, "seed": 1}
    plain = run_rounds(topology, "matcha", data, **options).results
    unclipped = run_rounds(topology, "matcha", data, robust="clip", tau=math.inf, **options)
    assert torch.equal(plain, unclipped.results)
    clipped = run_rounds(topology, "matcha", data, robust="clip", tau=0.5, **options).results
    assert not torch.equal(plain, clipped)
    torch.testing.assert_close(clipped.mean(dim=1), data.mean(dim=1), rtol=1e-12, atol=1e-12)


def test_choco_clips_the_mixing_term_over_public_copies(iterate, local_topology):
    """dpsgd with a compressor and robust=clip: the replicas still follow the raw payloads
    (each x̂_j held by i equals j's own), an infinite radius is CHOCO, and a common radius
    keeps the peers' average."""
    topology = local_topology("ring", 5)
    x0 = torch.randn(5, 61, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    choco = {"compressor": "topk", "density": 0.2}
    plain, _ = iterate(topology, "dpsgd", x0, 6, **choco)
    unclipped, _ = iterate(topology, "dpsgd", x0, 6, robust="clip", tau=math.inf, **choco)
    torch.testing.assert_close(unclipped, plain, rtol=1e-12, atol=1e-12)
    clipped, strategies = iterate(topology, "dpsgd", x0, 6, robust="clip", tau=0.05, **choco)
    assert not torch.allclose(clipped, plain)
    torch.testing.assert_close(clipped.mean(0), x0.mean(0), rtol=1e-12, atol=1e-12)
    for strategy in strategies:
        for j, copy in strategy.replicas.copies.items():
            assert torch.equal(copy, strategies[j].public)
        assert strategy.record_fields(5)["robust_share"] > 0


@pytest.mark.parametrize("payload", ["nan", "+1e38", "per-neighbour", "sign-flip"])
def test_choco_with_liars_everywhere_moves_at_most_gamma_times_the_clipped_weight(
        payload, local_topology, make_data):
    """CHOCO's step x_i += gamma sum_j w_ij CLIP(x̂_j - x̂_i, tau): whatever the liars' public
    copies become, x_0 moves at most gamma (1 - w_00) tau per round."""
    topology = local_topology("star", 4)
    data = make_data(3, 4, (NUMEL,), torch.float32, seed=9)
    options = {"compressor": "topk", "density": 1.0, "gamma": 0.5, "robust": "clip",
               "tau": 0.5}
    results, strategies = run_with_attackers(topology, options, data,
                                             {r: PAYLOADS[payload] for r in (1, 2, 3)})
    bound = 0.5 * (1 - strategies[0].self_weight) * 0.5
    for round in range(3):
        moved = torch.linalg.vector_norm(results[round, 0].double() - data[round, 0].double())
        assert float(moved) <= bound * (1 + 1e-5)
    assert strategies[0].record_fields(2)["robust_flagged"] == (3 if payload == "nan" else 0)
