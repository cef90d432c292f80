"""MATCHA plan: matching decomposition, probabilities, alpha/rho, schedule and the CLI.

References are independent of the code under test: brute-force grids with refinement and an
LP cutting-plane method for the probabilities, a dense grid for alpha, enumeration of every
activation pattern for the expectations, and the worked examples of the spec.
"""

from __future__ import annotations

import itertools
import json
import math
import random

import networkx as nx
import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from gossip.cli import main
from gossip.errors import ConfigError, TopologyError
from gossip.topology import Topology, matcha, matcha_solver
from gossip.topology import matchings as colouring
from gossip.topology.matcha import MatchaPlan

# Reference graph 0 of the spec (8-node Erdos-Renyi) with its hand-made decomposition.
GRAPH0 = [[(1, 5), (6, 7), (0, 4), (2, 3)], [(1, 7), (3, 6)], [(1, 0), (3, 7), (5, 6)],
          [(1, 2), (7, 0)], [(3, 1)]]
IRREGULAR7 = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (2, 5), (4, 5), (5, 6)]


def graph(kind: str, n: int | None = None, **params) -> nx.Graph:
    return nx.Graph(Topology.generate(kind, n, **params).edges())


def er_graph(seed: int) -> nx.Graph:
    rng = random.Random(seed)
    size = rng.randint(4, 9)
    while True:
        g = nx.gnp_random_graph(size, rng.uniform(0.3, 0.7), seed=rng.randrange(10**6))
        if nx.is_connected(g):
            return g


GRAPHS = {
    "ring-3": graph("ring", 3), "ring-5": graph("ring", 5), "ring-8": graph("ring", 8),
    "line-6": graph("line", 6), "star-6": graph("star", 6), "complete-4": graph("complete", 4),
    "complete-7": graph("complete", 7), "complete-8": graph("complete", 8), "torus-3x4": graph("torus", rows=3, cols=4),
    "exponential-8": graph("exponential", 8), "irregular-7": nx.Graph(IRREGULAR7),
    "graph0": nx.Graph([e for m in GRAPH0 for e in m]), "petersen": nx.petersen_graph(),
    **{f"er-{seed}": er_graph(seed) for seed in range(4)},
}


def max_degree(g: nx.Graph) -> int:
    return max(d for _, d in g.degree())


def assert_partition(g: nx.Graph, matchings) -> None:
    edges = sorted((min(a, b), max(a, b)) for a, b in g.edges())
    assert sorted(e for m in matchings for e in m) == edges  # every edge exactly once
    for m in matchings:
        ranks = [r for e in m for r in e]
        assert len(ranks) == len(set(ranks)), f"{m} is not a matching"
        assert all(a < b for a, b in m)


# -- decomposition ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GRAPHS))
def test_matchings_partition_the_edges_with_at_most_delta_plus_one(name):
    g = GRAPHS[name]
    matchings = matcha.decompose(g.edges())
    assert_partition(g, matchings)
    assert max_degree(g) <= len(matchings) <= max_degree(g) + 1


@pytest.mark.parametrize("name", ["ring-8", "line-6", "star-6", "torus-3x4", "complete-4",
                                  "complete-8", "exponential-8", "irregular-7", "graph0"])
def test_delta_colours_where_they_exist(name):
    """Bipartite graphs (Koenig) and these class-1 graphs need only Delta matchings."""
    assert len(matcha.decompose(GRAPHS[name].edges())) == max_degree(GRAPHS[name])


@pytest.mark.parametrize("name", ["ring-5", "complete-7", "petersen"])
def test_class_two_graphs_get_delta_plus_one(name):
    assert len(matcha.decompose(GRAPHS[name].edges())) == max_degree(GRAPHS[name]) + 1


def test_ring_8_decomposition_is_the_spec_one():
    assert matcha.decompose(GRAPHS["ring-8"].edges()) == (
        ((0, 1), (2, 3), (4, 5), (6, 7)), ((0, 7), (1, 2), (3, 4), (5, 6)))


@pytest.mark.parametrize("name", ["exponential-8", "petersen", "er-1"])
def test_decomposition_ignores_edge_order_and_orientation(name):
    edges = list(GRAPHS[name].edges())
    shuffled = [(b, a) if i % 2 else (a, b) for i, (a, b) in enumerate(edges)]
    random.Random(0).shuffle(shuffled)
    assert matcha.decompose(shuffled) == matcha.decompose(edges)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 14).flatmap(lambda n: st.sets(
    st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda e: e[0] < e[1]),
    min_size=1, max_size=n * (n - 1) // 2)))
def test_any_graph_is_partitioned(edges):
    g = nx.Graph(sorted(edges))
    matchings = matcha.decompose(edges)
    assert_partition(g, matchings)
    assert len(matchings) <= max_degree(g) + 1
    assert matcha.decompose(sorted(edges, reverse=True)) == matchings


@pytest.mark.parametrize("seed", range(20))
def test_misra_gries_fallback_is_proper_with_delta_plus_one(seed):
    g = nx.gnp_random_graph(random.Random(seed).randint(3, 25), 0.4, seed=seed)
    edges = sorted(g.edges())
    if not edges:
        return
    k = max_degree(g) + 1
    colours = colouring._misra_gries(g.number_of_nodes(), edges, k)
    assert all(0 <= c < k for c in colours)
    for v in g:
        at_v = [c for e, c in zip(edges, colours) if v in e]
        assert len(at_v) == len(set(at_v)), f"colour clash at {v}"


def test_self_loop_and_duplicate_edges_are_rejected():
    with pytest.raises(TopologyError, match="self-loop"):
        matcha.decompose([(0, 1), (2, 2)])
    with pytest.raises(TopologyError, match="duplicate edge 0-1"):
        matcha.decompose([(0, 1), (1, 0)])


# -- probabilities ------------------------------------------------------------------------


def lambda2(laplacians: np.ndarray, p: np.ndarray) -> np.ndarray:
    """lambda_2 of sum_j p_j L_j for a batch of p (rows)."""
    return np.linalg.eigvalsh(np.einsum("km,mij->kij", np.atleast_2d(p), laplacians))[:, 1]


def brute_force(laplacians: np.ndarray, total: float) -> float:
    """Max lambda_2 over a grid of the slice sum(p) = total (lambda_2 is monotone in p),
    zoomed in five times around the best point."""
    count = len(laplacians)
    centre, step, width = np.full(count - 1, 0.5), 1.0 / 40, 21
    best = -math.inf
    for _ in range(6):
        axes = [c + step * np.arange(-width, width + 1) for c in centre]
        free = np.array(list(itertools.product(*axes)))
        p = np.column_stack([free, total - free.sum(axis=1)])
        p = p[np.all((p >= 0) & (p <= 1), axis=1)]
        values = lambda2(laplacians, p)
        if values.max() >= best:
            best, centre = values.max(), p[values.argmax(), :-1]
        step /= 8
        width = 12
    return float(best)


def cutting_plane(laplacians: np.ndarray, total: float, tol: float = 1e-7):
    """Kelley's LP cutting planes: (lower, upper) bounds on max lambda_2."""
    count, size = laplacians.shape[:2]
    basis = np.linalg.qr(np.column_stack([np.ones(size), np.eye(size)[:, :-1]]))[0][:, 1:]
    reduced = np.einsum("pi,mpq,qj->mij", basis, laplacians, basis)
    cuts, lower, upper = [], -math.inf, math.inf
    p = np.full(count, total / count)
    for _ in range(1000):
        w, v = np.linalg.eigh(np.tensordot(p, reduced, axes=1))
        lower = max(lower, w[0])
        for k in np.flatnonzero(w <= w[0] + 1e-9):  # t <= v' (sum p_j A_j) v for unit v
            cuts.append(np.einsum("p,mpq,q->m", v[:, k], reduced, v[:, k]))
        if upper - lower < tol:
            break
        a_ub = [np.append(-c, 1.0) for c in cuts] + [np.append(np.ones(count), 0.0)]
        res = linprog(np.append(np.zeros(count), -1.0), A_ub=np.array(a_ub),
                      b_ub=[0.0] * len(cuts) + [total], bounds=[(0, 1)] * count + [(None, None)])
        p, upper = res.x[:count], -res.fun
    return lower, upper


GRAPHS["irregular-5"] = nx.Graph([(0, 1), (1, 2), (0, 2), (2, 3), (3, 4)])
GRAPHS["star-4"] = graph("star", 4)
# Fast lane: one plan of three matchings and one of two; the rest in the full suite.
BRUTE = ["ring-3", "line-6", *(pytest.param(name, marks=pytest.mark.slow)
                               for name in ["ring-5", "star-4", "complete-4", "irregular-5"])]


@pytest.mark.parametrize("budget", [0.5, *(pytest.param(b, marks=pytest.mark.slow)
                                     for b in (0.2, 0.7))])
@pytest.mark.parametrize("name", BRUTE)
def test_probabilities_match_brute_force(name, budget):
    plan = matcha.plan(GRAPHS[name], budget)
    laps = plan.laplacians()
    assert len(laps) in (2, 3)
    best = brute_force(laps, budget * len(laps))
    assert plan.lambda2 >= best - 1e-9, "the grid found a better point"
    assert plan.lambda2 == pytest.approx(best, abs=1e-6)
    assert plan.lambda2 == pytest.approx(lambda2(laps, np.array(plan.probabilities))[0],
                                         abs=1e-12)


@pytest.mark.parametrize("budget", [0.25, 0.6])
@pytest.mark.parametrize("name", ["star-6", "exponential-8", *(
    pytest.param(name, marks=pytest.mark.slow) for name in ["irregular-7", "graph0", "er-0",
                                                            "er-2"])])
def test_probabilities_match_cutting_planes(name, budget):
    plan = matcha.plan(GRAPHS[name], budget)
    lower, upper = cutting_plane(plan.laplacians(), budget * len(plan.matchings))
    assert lower - 1e-9 <= plan.lambda2 <= upper + 1e-9
    assert upper - plan.lambda2 < 1e-6


@pytest.mark.parametrize("name", ["irregular-7", *(pytest.param(name, marks=pytest.mark.slow)
                                                  for name in ["exponential-8", "er-3"])])
def test_no_random_feasible_point_is_better(name):
    plan = matcha.plan(GRAPHS[name], 0.4)
    laps, total = plan.laplacians(), 0.4 * len(plan.matchings)
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(len(laps)), size=4000) * total
    p = p[np.all(p <= 1, axis=1)]
    near = np.clip(np.array(plan.probabilities) + rng.normal(0, 0.02, (4000, len(laps))), 0, 1)
    near = near[near.sum(axis=1) <= total]
    assert len(p) > 100 and len(near) > 100
    assert lambda2(laps, np.vstack([p, near])).max() <= plan.lambda2 + 1e-9


@pytest.mark.parametrize("budget", [0.05, 0.3, 0.5, 0.99, 1.0])
@pytest.mark.parametrize("name", ["irregular-7", "graph0", "petersen", "er-1"])
def test_probabilities_respect_the_budget(name, budget):
    plan = matcha.plan(GRAPHS[name], budget)
    p = np.array(plan.probabilities)
    assert np.all((p >= 0) & (p <= 1))
    assert p.sum() <= budget * len(p) + 1e-9
    assert p.sum() == pytest.approx(min(budget, 1.0) * len(p), abs=1e-6)  # budget is binding
    assert plan.rho < 1


def test_full_budget_activates_everything():
    plan = matcha.plan(GRAPHS["irregular-7"], 1.0)
    assert plan.probabilities == (1.0,) * len(plan.matchings)


# -- alpha and rho ------------------------------------------------------------------------


def dense_alpha(plan: MatchaPlan) -> tuple[float, float]:
    """argmin and min of ||E[W^T W] - J||_2 on a dense alpha grid, zoomed in."""
    mean, var = matcha_solver.expected_matrices(plan.laplacians(), np.array(plan.probabilities))
    size = plan.size
    j = np.full((size, size), 1.0 / size)
    square = mean @ mean + 2 * var

    def norms(alphas):
        mats = (np.eye(size) - 2 * alphas[:, None, None] * mean
                + alphas[:, None, None] ** 2 * square - j)
        return np.abs(np.linalg.eigvalsh(mats)).max(axis=1)

    alphas = np.linspace(0, 2.5, 2501)
    for _ in range(4):
        values = norms(alphas)
        best = alphas[values.argmin()]
        step = alphas[1] - alphas[0]
        alphas = np.linspace(max(best - 2 * step, 0), best + 2 * step, 401)
    values = norms(alphas)
    return float(alphas[values.argmin()]), float(values.min())


@pytest.mark.parametrize("budget", [0.1, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("name", ["ring-8", "irregular-7", "star-6", "graph0", "er-2"])
def test_alpha_and_rho_match_a_dense_grid(name, budget):
    plan = matcha.plan(GRAPHS[name], budget)
    alpha, rho = dense_alpha(plan)
    assert plan.rho <= rho + 1e-10
    assert plan.rho == pytest.approx(rho, abs=1e-9)
    assert plan.alpha == pytest.approx(alpha, abs=1e-5)


@pytest.mark.parametrize("name", ["irregular-7", "graph0"])
def test_alpha_solves_the_spec_sdp(name):
    """(a, b, s) = (alpha, alpha^2, rho) is feasible for the spec's SDP, and no b > a^2
    helps: the SDP optimum is the 1-D minimum."""
    plan = matcha.plan(GRAPHS[name], 0.5)
    mean, var = matcha_solver.expected_matrices(plan.laplacians(), np.array(plan.probabilities))
    size, square = plan.size, mean @ mean + 2 * var
    j = np.full((size, size), 1.0 / size)

    def lhs(a, b, s):
        return (1 - s) * np.eye(size) - 2 * a * mean - j + b * square

    assert np.linalg.eigvalsh(lhs(plan.alpha, plan.alpha**2, plan.rho))[-1] <= 1e-9
    assert np.linalg.eigvalsh(lhs(plan.alpha, plan.alpha**2, plan.rho - 1e-6))[-1] > 0
    for a in np.linspace(0, 1.5, 31):
        for b in a**2 + np.array([0.0, 0.01, 0.1]):
            s_min = np.linalg.eigvalsh(lhs(a, b, 0.0))[-1]  # smallest feasible s at (a, b)
            assert s_min >= plan.rho - 1e-9


def test_full_budget_alpha_is_two_over_the_extreme_eigenvalues():
    """C_b = 1: alpha = 2 / (lambda_2 + lambda_max) of the base Laplacian (spec §8.2)."""
    g = GRAPHS["irregular-7"]
    eig = np.linalg.eigvalsh(nx.laplacian_matrix(g, nodelist=range(7)).toarray())
    plan = matcha.plan(g, 1.0)
    assert plan.alpha == pytest.approx(2 / (eig[1] + eig[-1]), abs=1e-9)
    assert plan.rho == pytest.approx(((eig[-1] - eig[1]) / (eig[-1] + eig[1])) ** 2, abs=1e-9)


@pytest.mark.parametrize("budget", [0.2, 0.5, 0.9])
def test_two_peers_closed_form(budget):
    """One edge: p = C_b, alpha = 1/2, rho = 1 - C_b."""
    plan = matcha.plan(nx.Graph([(0, 1)]), budget)
    assert plan.probabilities == pytest.approx((budget,), abs=1e-8)
    assert plan.alpha == pytest.approx(0.5, abs=1e-6)
    assert plan.rho == pytest.approx(1 - budget, abs=1e-8)


def patterns(plan: MatchaPlan):
    """Every activation pattern with its probability."""
    for flags in itertools.product([0, 1], repeat=len(plan.matchings)):
        weight = math.prod(p if f else 1 - p for f, p in zip(flags, plan.probabilities))
        yield [j for j, f in enumerate(flags) if f], weight


def hand_mixing(plan: MatchaPlan, active) -> np.ndarray:
    w = np.eye(plan.size)
    for j in active:
        for a, b in plan.matchings[j]:
            w[a, b] += plan.alpha
            w[b, a] += plan.alpha
            w[a, a] -= plan.alpha
            w[b, b] -= plan.alpha
    return w


@pytest.mark.parametrize("name", ["irregular-7", "graph0", "ring-5"])
def test_expectations_match_enumeration(name):
    plan = matcha.plan(GRAPHS[name], 0.45)
    mean_w = sum(weight * hand_mixing(plan, active) for active, weight in patterns(plan))
    gram = sum(weight * hand_mixing(plan, active).T @ hand_mixing(plan, active)
               for active, weight in patterns(plan))
    np.testing.assert_allclose(plan.expected_mixing_matrix(), mean_w, atol=1e-12)
    np.testing.assert_allclose(plan.expected_gram(), gram, atol=1e-12)
    j = np.full((plan.size, plan.size), 1 / plan.size)
    assert np.linalg.norm(gram - j, 2) == pytest.approx(plan.rho, abs=1e-10)


@pytest.mark.parametrize("name", ["irregular-7", "graph0", "petersen"])
def test_expected_and_sampled_mixing_matrices_are_doubly_stochastic(name):
    plan = matcha.plan(GRAPHS[name], 0.5)
    for w in [plan.expected_mixing_matrix(), *(plan.mixing_matrix(k, 3) for k in range(20))]:
        np.testing.assert_allclose(w, w.T, atol=0)
        np.testing.assert_allclose(w.sum(axis=0), 1, atol=1e-12)
        np.testing.assert_allclose(w.sum(axis=1), 1, atol=1e-12)


# -- spec worked examples (§6) ------------------------------------------------------------


@pytest.mark.parametrize("budget, p, lam2, alpha, rho", [
    (0.25, (0.25, 0.25), 0.1464, 0.6074, 0.9111),
    (0.5, (0.5, 0.5), 0.2929, 0.6074, 0.7839),
    (0.75, (0.75, 0.75), 0.4393, 0.5077, 0.6603),
    (1.0, (1.0, 1.0), 0.5858, 0.4361, 0.5543),
])
def test_spec_ring_8(budget, p, lam2, alpha, rho):
    plan = matcha.plan(GRAPHS["ring-8"], budget)
    assert plan.probabilities == pytest.approx(p, abs=1e-3)
    assert (plan.lambda2, plan.alpha, plan.rho) == pytest.approx((lam2, alpha, rho), abs=1e-3)


@pytest.mark.parametrize("budget, alpha, rho", [
    (0.25, 0.5, 0.75), (0.5, 0.4, 0.52), (0.75, 0.3077, 0.3609), (1.0, 0.25, 0.25)])
def test_spec_torus_2x4(budget, alpha, rho):
    plan = matcha.plan(graph("torus", rows=2, cols=4), budget)
    assert len(plan.matchings) == 3
    assert plan.probabilities == pytest.approx((budget,) * 3, abs=1e-3)
    assert (plan.alpha, plan.rho) == pytest.approx((alpha, rho), abs=1e-3)


@pytest.mark.parametrize("budget, p, lam2, alpha, rho", [
    (0.25, (0.492, 0, 0.379, 0.379, 0), 0.2806, 0.5540, 0.8161),
    (0.5, (0.984, 0, 0.758, 0.758, 0), 0.5612, 0.3964, 0.6440),
    (0.75, (1, 0.099, 1, 1, 0.652), 0.6647, 0.3329, 0.6079),
    (1.0, (1, 1, 1, 1, 1), None, 0.2857, 0.6538),
])
def test_spec_reference_graph_0(budget, p, lam2, alpha, rho):
    plan = matcha.plan(GRAPHS["graph0"], budget, matchings=GRAPH0)
    by_matching = dict(zip(plan.matchings, plan.probabilities))
    ordered = [by_matching[tuple(sorted((min(e), max(e)) for e in m))] for m in GRAPH0]
    assert ordered == pytest.approx(p, abs=1e-3)
    if lam2 is not None:
        assert plan.lambda2 == pytest.approx(lam2, abs=1e-3)
    assert (plan.alpha, plan.rho) == pytest.approx((alpha, rho), abs=1e-3)


# -- schedule -----------------------------------------------------------------------------


def test_schedule_is_a_pure_function_of_seed_and_round():
    plan = matcha.plan(GRAPHS["graph0"], 0.5)
    forward = [plan.active(k, 7) for k in range(200)]
    backward = [plan.active(k, 7) for k in reversed(range(200))][::-1]
    matcha.plan_for_matchings.cache_clear()
    other = matcha.plan(GRAPHS["graph0"], 0.5)  # another peer computes its own plan
    assert other == plan and other is not plan
    assert forward == backward == [other.active(k, 7) for k in range(200)]
    assert forward != [plan.active(k, 8) for k in range(200)]
    assert all(list(a) == sorted(set(a)) for a in forward)
    assert len(set(forward)) > 5  # the activations really vary


def test_activation_frequencies_match_probabilities():
    plan = matcha.plan(GRAPHS["irregular-7"], 0.4)
    rounds = 4000
    counts = np.zeros(len(plan.matchings))
    pairs = np.zeros((len(plan.matchings),) * 2)
    for k in range(rounds):
        flags = np.zeros(len(plan.matchings))
        flags[list(plan.active(k, 1))] = 1
        counts += flags
        pairs += np.outer(flags, flags)
    p = np.array(plan.probabilities)
    assert np.all(np.abs(counts - rounds * p) <= 5 * np.sqrt(rounds * p * (1 - p)) + 1)
    joint = np.outer(p, p)  # independent activations
    off = ~np.eye(len(p), dtype=bool)
    tol = 5 * np.sqrt(rounds * joint * (1 - joint)) + 1
    assert np.all(np.abs(pairs - rounds * joint)[off] <= tol[off])


def test_full_budget_is_a_fixed_mixing_matrix():
    g = GRAPHS["exponential-8"]
    plan = matcha.plan(g, 1.0)
    lap = nx.laplacian_matrix(g, nodelist=range(8)).toarray()
    for k in range(30):
        assert plan.active(k, 5) == tuple(range(len(plan.matchings)))
        np.testing.assert_allclose(plan.mixing_matrix(k, 5), np.eye(8) - plan.alpha * lap,
                                   atol=1e-15)


def test_partners():
    plan = matcha.plan(GRAPHS["irregular-7"], 0.5)
    for rank in range(7):
        partners = plan.partners(rank)
        assert sorted(q for q in partners if q is not None) == sorted(GRAPHS["irregular-7"][rank])
        for j, q in enumerate(partners):
            assert q is None or plan.partners(q)[j] == rank  # symmetric


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, -0.5, 1.0001, float("nan"), float("inf"), "0.5", True,
                                    None])
def test_budget_outside_the_unit_interval_is_a_config_error(budget):
    with pytest.raises(ConfigError, match="budget"):
        matcha.plan(GRAPHS["ring-5"], budget)


@pytest.mark.parametrize("round, seed", [(-1, 0), (0, -2), (1.5, 0), (0, "x"), (True, 0)])
def test_bad_round_or_seed(round, seed):
    with pytest.raises(ConfigError, match="round|seed"):
        matcha.plan(GRAPHS["ring-5"], 0.5).active(round, seed)


def test_bad_graphs_and_matchings():
    with pytest.raises(TopologyError, match="connected"):
        matcha.plan(nx.Graph([(0, 1), (2, 3)]), 0.5)
    with pytest.raises(TopologyError, match="union"):
        matcha.plan(GRAPHS["ring-5"], 0.5, matchings=[[(0, 1)], [(1, 2), (3, 4)]])
    with pytest.raises(TopologyError, match="not a matching"):
        MatchaPlan(size=3, matchings=(((0, 1), (1, 2)),), probabilities=(0.5,), alpha=0.5,
                   rho=0.5, budget=0.5, lambda2=0.0, lambda_max=0.0)
    with pytest.raises(ConfigError, match="probabilities"):
        MatchaPlan(size=2, matchings=(((0, 1),),), probabilities=(1.5,), alpha=0.5,
                   rho=0.5, budget=0.5, lambda2=0.0, lambda_max=0.0)


def test_accepts_a_topology():
    topo = Topology.generate("ring", 8)
    assert matcha.plan(topo, 0.5) == matcha.plan(GRAPHS["ring-8"], 0.5)


# -- command line -------------------------------------------------------------------------


def test_cli_json(tmp_path):
    result = CliRunner().invoke(main, ["topology", "show", "topologies/irregular-7.yaml",
                                       "--budget", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # one JSON object and nothing else
    plan = matcha.plan(Topology.from_yaml("topologies/irregular-7.yaml"), 0.5)
    assert data["matchings"] == [[list(e) for e in m] for m in plan.matchings]
    assert data["probabilities"] == pytest.approx(plan.probabilities, abs=1e-12)
    assert (data["alpha"], data["rho"], data["budget"]) == (plan.alpha, plan.rho, 0.5)
    assert data["lambda2"] == plan.lambda2


def test_cli_text_appends_the_matcha_section():
    result = CliRunner().invoke(main, ["topology", "show", "topologies/ring-8.yaml",
                                       "--budget", "0.5"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text.startswith("topology ring-8: P=8")
    assert "matching 0  p = 0.5000  0-1 2-3 4-5 6-7" in text
    assert "alpha: 0.6074" in text and "0.7839" in text
    assert "expected matchings per round: 1.000 (D-PSGD, all matchings: 2)" in text


def test_cli_without_budget_has_no_matcha_section():
    result = CliRunner().invoke(main, ["topology", "show", "topologies/ring-8.yaml"])
    assert result.exit_code == 0 and "MATCHA" not in result.stdout
    result = CliRunner().invoke(main, ["topology", "show", "topologies/ring-8.yaml", "--json"])
    data = json.loads(result.stdout)
    assert data["size"] == 8 and "matchings" not in data


@pytest.mark.parametrize("budget", ["0", "1.5", "abc", "-1", "nan"])
def test_cli_bad_budget_is_one_line_and_exit_1(budget):
    result = CliRunner().invoke(main, ["topology", "show", "topologies/ring-8.yaml",
                                       "--budget", budget, "--json"])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "budget" in lines[0]
