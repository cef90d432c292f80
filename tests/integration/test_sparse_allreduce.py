"""topk-allgather, gtopk and spardl between real peers over ZeroMQ on loopback (threads), and
in network namespaces with distinct IPs where root is available.

Oracles, computed here independently in numpy from the specs' pseudo-code:
* density 1.0: the exact mean, no residual;
* mass: sum over peers of (x + old residual) == P * result + sum of new residuals;
* topk-allgather: sum of every peer's top-k / P; gtopk: the binomial merge tree of the spec
  (merge = top-k of the union, sums on coinciding indices, np.unique + np.add.at), with both
  residual rules; spardl: the spec's Spar-Reduce-Scatter / Spar-All-Gather with dense
  ``own``/``cand`` copies and the global residual collection;
* every peer returns the same tensor; residuals are carried into the next round.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from gossip.cluster import VirtualCluster, unavailable_reason
from gossip.compress.sparse import k_for
from gossip.peer import Peer
from support import peer_once_all_bound

# Peer counts; the fast lane runs up to 5.
SIZES = [1, 2, 3, 5, *(pytest.param(size, marks=pytest.mark.slow) for size in (6, 7, 8))]
NAMES = ["topk-allgather", "gtopk", "spardl"]
pytestmark = pytest.mark.timeout(120)


def length(size: int) -> int:
    return 13 * size + 5  # never divisible by P > 1


@dataclass
class Spec:
    """One strategy instance: its options and inputs ``data[round, rank, n]`` (float32)."""

    name: str
    options: dict
    data: torch.Tensor
    results: torch.Tensor = field(init=False)
    residuals: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.results = torch.full_like(self.data, float("nan"))
        self.residuals = torch.full_like(self.data, float("nan"))


@pytest.fixture
def run(local_topology, run_peers):
    """``run(P, specs, inplace=False)``: see run_specs."""
    return lambda size, specs, **kw: run_specs(local_topology, run_peers, size, specs, **kw)


def run_specs(local_topology, run_peers, size: int, specs: list[Spec], *, inplace: bool = False,
              timeout: float = 20) -> None:
    """Every peer runs every spec's rounds (one strategy instance each, distinct tags); once
    all closed, everything sent was received and nothing was rejected."""
    topology = local_topology("ring", size)
    stats: list[dict] = [{}] * size
    all_bound = threading.Barrier(size, timeout=timeout)

    def peer_main(rank: int) -> None:
        with peer_once_all_bound(rank, topology, "ring-allreduce", all_bound,
                                 timeout=timeout) as peer:
            strategies = [peer.add_strategy(s.name, tag=f"s{i}", **s.options)
                          for i, s in enumerate(specs)]
            for round in range(max(s.data.shape[0] for s in specs)):
                for spec, strategy in zip(specs, strategies):
                    if round >= spec.data.shape[0]:
                        continue
                    x = spec.data[round, rank].clone()
                    y = strategy.synchronize(x, round, out=x if inplace else None)
                    assert y.shape == x.shape and (not inplace or y.data_ptr() == x.data_ptr())
                    spec.results[round, rank] = y
                    spec.residuals[round, rank] = strategy.residual
        stats[rank] = peer.stats

    run_peers(size, peer_main, timeout=3 * timeout)
    for key in ("bytes", "messages"):
        assert sum(s[f"{key}_sent"] for s in stats) == sum(s[f"{key}_recv"] for s in stats)
    assert sum(s["messages_rejected"] for s in stats) == 0


def data(rounds: int, size: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(rounds, size, n, generator=torch.Generator().manual_seed(seed))


def inputs(spec: Spec, round: int) -> np.ndarray:
    """What the peers put in at round ``round``: x + the residual they carried."""
    x = spec.data[round].double().numpy()
    return x if round == 0 else x + spec.residuals[round - 1].double().numpy()


def assert_identical_on_all_peers(spec: Spec) -> None:
    for rank in range(1, spec.data.shape[1]):
        assert torch.equal(spec.results[:, rank], spec.results[:, 0]), f"rank {rank} differs"


def assert_conserved(spec: Spec) -> None:
    size = spec.data.shape[1]
    for round in range(spec.data.shape[0]):
        put_in = inputs(spec, round).sum(axis=0)
        out = size * spec.results[round, 0].double().numpy() + \
            spec.residuals[round].double().numpy().sum(axis=0)
        np.testing.assert_allclose(out, put_in, rtol=1e-5, atol=1e-5 * size,
                                   err_msg=f"{spec.name} round {round}: mass not conserved")


# -- independent oracles -----------------------------------------------------------------


def topk(a: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the k largest |a| by a full sort; exact zeros are never sent."""
    idx = np.sort(np.argsort(-np.abs(a), kind="stable")[:k])
    return idx[a[idx] != 0]


def oracle_topk_allgather(a: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    size, n = a.shape
    result, residual = np.zeros(n, np.float32), a.copy()
    for rank in range(size):
        idx = topk(a[rank], k)
        result[idx] += a[rank, idx] / np.float32(size)
        residual[rank, idx] = 0
    return result, residual


def merge_topk(ai, av, bi, bv, k):
    """The spec's merge: unique + segment sum, then the top-k of |sum| (rest returned too)."""
    u, inverse = np.unique(np.concatenate([ai, bi]), return_inverse=True)
    s = np.zeros(u.size, np.float32)
    np.add.at(s, inverse, np.concatenate([av, bv]))
    keep = topk(s, k) if u.size else u
    kept = np.isin(np.arange(u.size), keep)
    return u[keep], s[keep], u[~kept], s[~kept]


def oracle_gtopk(a: np.ndarray, k: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    size, n = a.shape
    residual = a.copy()
    local, cur = [], []
    for rank in range(size):
        idx = topk(a[rank], k)
        local.append((idx, a[rank, idx]))
        cur.append((idx, a[rank, idx]))
        residual[rank, idx] = 0
    d = 1
    while d < size:  # the spec's binomial reduce, level by level
        for r in range(0, size, 2 * d):
            if r + d < size:
                gi, gv, lost, lost_val = merge_topk(*cur[r], *cur[r + d], k)
                cur[r] = (gi, gv)
                if mode == "conserve":
                    residual[r, lost] += lost_val
        d *= 2
    gi, gv = cur[0]
    result = np.zeros(n, np.float32)
    result[gi] = gv / np.float32(size)
    if mode == "reference":
        for rank, (idx, val) in enumerate(local):
            back = ~np.isin(idx, gi)
            residual[rank, idx[back]] += val[back]
    return result, residual


def oracle_spardl(a: np.ndarray, density: float) -> tuple[np.ndarray, np.ndarray]:
    """The spec's pseudo-code, every peer in lock step."""
    size, n = a.shape
    blen = -(-n // size)
    kb = k_for(density, blen)
    acc = np.zeros((size, size * blen), np.float32)
    acc[:, :n] = a
    own, cand = acc.copy(), acc.copy()

    def block(r, b):
        return slice(b * blen, (b + 1) * blen)

    steps = math.ceil(math.log2(size)) if size > 1 else 0
    sizes = [size - 2 ** (steps - 1)] + [2 ** (steps - 2 - i) for i in range(steps - 1)]
    for s in range(steps):
        d, m = 2 ** (steps - 1 - s), sizes[s]
        messages = {}
        for r in range(size):
            out = []
            for j in range(m):
                b = (r + d + j) % size
                sel = topk(acc[r, block(r, b)], kb)
                out.append((b, sel, acc[r, block(r, b)][sel].copy()))
                cand[r, block(r, b)] = acc[r, block(r, b)]
                cand[r, block(r, b)][sel] = 0
            messages[(r + d) % size] = out
        for r, out in messages.items():
            for b, sel, v in out:
                acc[r, block(r, b)][sel] += v
    final = {}
    for r in range(size):
        sel = topk(acc[r, block(r, r)], kb)
        final[r] = (sel, acc[r, block(r, r)][sel].copy())
        cand[r, block(r, r)] = acc[r, block(r, r)]
        cand[r, block(r, r)][sel] = 0
    result = np.zeros(size * blen, np.float32)
    residual = own.copy()
    for b, (sel, v) in final.items():
        result[block(0, b)][sel] = v / np.float32(size)
        for r in range(size):
            residual[r, block(r, b)][sel] = cand[r, block(r, b)][sel]
    return result[:n], residual[:, :n]


def assert_matches(spec: Spec, oracle) -> None:
    """Round by round, the result and every residual equal the oracle's on the same input."""
    for round in range(spec.data.shape[0]):
        a = inputs(spec, round).astype(np.float32)
        result, residual = oracle(a)
        np.testing.assert_allclose(spec.results[round, 0].numpy(), result, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{spec.name} round {round}: result")
        assert np.array_equal(spec.results[round, 0].numpy() != 0, result != 0), \
            f"{spec.name} round {round}: different non-zeros"
        np.testing.assert_allclose(spec.residuals[round].numpy(), residual, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{spec.name} round {round}: residuals")


def oracle_for(spec: Spec):
    n = spec.data.shape[2]
    density = spec.options.get("density", 0.01)
    if spec.name == "topk-allgather":
        return lambda a: oracle_topk_allgather(a, k_for(density, n))
    if spec.name == "gtopk":
        mode = spec.options.get("residual_mode", "conserve")
        return lambda a: oracle_gtopk(a, k_for(density, n), mode)
    return lambda a: oracle_spardl(a, density)


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_density_one_is_the_exact_mean(size, run):
    """All three, several lengths (shorter than P, not divisible by P), in place in round 1."""
    specs = [Spec(name, {"density": 1.0}, data(2, size, n, seed=10 * size + n))
             for name in NAMES for n in sorted({1, size + 1, length(size)})]
    run(size, specs[: len(specs) // 2])
    run(size, specs[len(specs) // 2:], inplace=True)
    for spec in specs:
        mean = spec.data.double().mean(dim=1)
        for rank in range(size):
            torch.testing.assert_close(spec.results[:, rank].double(), mean, rtol=1e-5,
                                       atol=1e-6, msg=lambda m, s=spec: f"{s.name}: {m}")
        assert spec.residuals.abs().max() <= 1e-6, spec.name
        assert_identical_on_all_peers(spec)


def sparse_specs(size: int) -> list[Spec]:
    """Densities 0.1, 0.01 and k = 1, three rounds each, lengths not divisible by P."""
    n, long = length(size), 1000 + 2 * size + 1
    specs = []
    for i, name in enumerate(NAMES):
        for density, m in [(0.1, n), (0.01, long), (1 / long, long)]:
            specs.append(Spec(name, {"density": density},
                              data(3, size, m, seed=100 * size + 10 * i + m)))
    return specs


@pytest.mark.parametrize("size", SIZES)
def test_sparse_results_match_the_oracles_and_conserve_mass(size, run):
    specs = sparse_specs(size)
    run(size, specs)
    for spec in specs:
        assert_identical_on_all_peers(spec)
        assert_matches(spec, oracle_for(spec))
        n = spec.data.shape[2]
        k = k_for(spec.options["density"], n)
        nonzeros = (spec.results[:, 0] != 0).sum(dim=1)
        if spec.name == "gtopk":
            assert nonzeros.max() <= k
        elif spec.name == "spardl":
            blen = -(-n // size)
            padded = torch.nn.functional.pad(spec.results[:, 0], (0, size * blen - n))
            per_block = (padded.view(-1, size, blen) != 0).sum(dim=2)
            assert per_block.max() <= k_for(spec.options["density"], blen)
        else:
            assert nonzeros.max() <= size * k
        assert_conserved(spec)
        # Residuals carried: round 2's input had round 1's residual in it, and it mattered.
        assert spec.residuals[1].abs().sum() > 0 or spec.options["density"] == 1.0


@pytest.mark.parametrize("size", [3, 5, 6])
def test_reference_residual_rule_loses_mass(size, run):
    """The published rule loses an entry cut at an intermediate merge whose index another
    branch brings into the global set; the default rule keeps it (in the merger's residual).

    k = 1. Rank 0 sends {0: 2}, rank 1 {1: 3}: their merge keeps index 1 and cuts index 0.
    Rank 2 sends {0: 5}, which wins the merge at rank 0: G = {0: 5}. Rank 0's 2 at index 0 is
    "in G" by index, so the reference rule treats it as consumed: 2 is lost.
    """
    x = torch.zeros(1, size, 4)
    x[0, 0, 0], x[0, 1, 1], x[0, 2, 0] = 2.0, 3.0, 5.0
    reference = Spec("gtopk", {"density": 0.25, "residual_mode": "reference"}, x)
    conserve = Spec("gtopk", {"density": 0.25}, x)
    run(size, [reference, conserve])
    expected = torch.tensor([5.0 / size, 0, 0, 0])
    assert torch.equal(reference.results[0, 0], expected)
    assert torch.equal(conserve.results[0, 0], expected)
    assert_conserved(conserve)
    assert conserve.residuals[0, 0].tolist() == [2.0, 3.0, 0, 0]  # rank 0 merged and cut both
    assert reference.residuals[0].sum(dim=0).tolist() == [0, 3.0, 0, 0]  # 1 back to rank 1
    with pytest.raises(AssertionError, match="mass not conserved"):
        assert_conserved(reference)


@pytest.mark.parametrize("size", [3, 7])
def test_reference_residual_rule_on_random_inputs(size, run):
    """On random inputs it matches the spec's rule exactly (the oracle), and loses mass."""
    x = data(2, size, 40, seed=size) + 2 * data(2, 1, 40, seed=0)  # overlapping top-k sets
    reference = Spec("gtopk", {"density": 0.2, "residual_mode": "reference"}, x)
    run(size, [reference])
    assert_matches(reference, oracle_for(reference))
    with pytest.raises(AssertionError, match="mass not conserved"):
        assert_conserved(reference)


@pytest.mark.parametrize("name", NAMES)
def test_without_error_feedback_each_round_starts_from_its_input(name, run):
    size, n = 3, length(3)
    spec = Spec(name, {"density": 0.1, "error_feedback": False}, data(2, size, n, seed=5))
    run(size, [spec])
    for round in range(2):
        result, _ = oracle_for(spec)(spec.data[round].numpy())
        np.testing.assert_allclose(spec.results[round, 0].numpy(), result, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_peer_synchronize_and_step(name, local_topology, run_peers):
    """Through Peer(strategy=...): synchronize returns the mean at density 1; step applies the
    same update on every peer (same init -> same parameters), different from a local step."""
    size = 3
    dense_topology, sparse_topology = local_topology("ring", size), local_topology("ring", size)
    params: list[torch.Tensor] = [torch.empty(0)] * size
    synced: list[torch.Tensor] = [torch.empty(0)] * size
    all_bound = threading.Barrier(size, timeout=10)
    xs = data(1, size, 17, seed=3)[0]

    def peer_main(rank: int) -> None:
        with Peer(rank, dense_topology, name, timeout=10, density=1.0) as dense, \
                Peer(rank, sparse_topology, name, timeout=10, density=0.1) as sparse:
            all_bound.wait()
            synced[rank] = dense.synchronize(xs[rank], 0)
            generator = torch.Generator().manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(),
                                        torch.nn.Linear(4, 2))
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=generator))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            batches = torch.Generator().manual_seed(rank)
            for _ in range(3):
                optimizer.zero_grad()
                model(torch.randn(5, 6, generator=batches)).square().mean().backward()
                sparse.step(model, optimizer)
            params[rank] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    run_peers(size, peer_main, timeout=30)
    for rank in range(size):
        torch.testing.assert_close(synced[rank], xs.mean(dim=0))
        assert torch.equal(params[rank], params[0])


# -- network namespaces ---------------------------------------------------------------------

NETNS_PEER = """
import sys, torch
from gossip.peer import Peer
from gossip.topology import Topology
rank, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
x = torch.randn(2, 3, 101, generator=torch.Generator().manual_seed(rank))
saved = {}
with Peer(rank, Topology.from_yaml(path), "ring-allreduce", timeout=30) as peer:
    # All kinds are registered before anything is read: no peer's message is refused.
    strategies = {(name, density): peer.add_strategy(name, tag=f"s{i}{j}", density=density)
                  for i, name in enumerate(["topk-allgather", "gtopk", "spardl"])
                  for j, density in enumerate([1.0, 0.05])}
    for (name, density), s in strategies.items():
        j = [1.0, 0.05].index(density)
        for round in range(2):
            saved[name, density, round] = (s.synchronize(x[round, j], round), s.residual.clone())
torch.save({"x": x, "saved": saved}, out)
"""


@pytest.fixture
def netns() -> None:
    reason = unavailable_reason()  # builds a throwaway namespace: only when this test runs
    if reason is not None:
        pytest.skip(f"netns virtual cluster unavailable: {reason}")


@pytest.mark.slow  # peer processes in network namespaces
def test_peers_with_distinct_ips_in_network_namespaces(netns, tmp_path):
    size = 3
    with VirtualCluster(size, rate="1gbit") as cluster:
        topology = cluster.topology("ring")
        assert len({p.host for p in topology.peers}) == size
        topology.to_yaml(tmp_path / "topology.yaml")
        procs = [cluster.popen(rank, [sys.executable, "-c", textwrap.dedent(NETNS_PEER),
                                      str(rank), str(tmp_path / "topology.yaml"),
                                      str(tmp_path / f"rank-{rank}.pt")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(size)]
        for proc in procs:
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
    runs = [torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(size)]
    x = torch.stack([run["x"] for run in runs], dim=2)  # [round, density, rank, n]
    for name in NAMES:
        for j, density in enumerate([1.0, 0.05]):
            carried = torch.zeros(size, 101)
            for round in range(2):
                results = [run["saved"][name, density, round][0] for run in runs]
                residuals = torch.stack([run["saved"][name, density, round][1] for run in runs])
                assert all(torch.equal(r, results[0]) for r in results), name
                put_in = (x[round, j] + carried).double().sum(dim=0)
                torch.testing.assert_close(size * results[0].double() + residuals.double().sum(0),
                                           put_in, rtol=1e-5, atol=1e-5)
                if density == 1.0:
                    torch.testing.assert_close(results[0], x[round, j].mean(dim=0))
                carried = residuals
