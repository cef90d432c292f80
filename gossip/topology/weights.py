"""Mixing-matrix weights and their spectral properties (pure functions)."""

from __future__ import annotations

import networkx as nx
import numpy as np


def metropolis_hastings(graph: nx.Graph) -> np.ndarray:
    """Metropolis-Hastings mixing matrix of an undirected graph on nodes ``0..P-1``.

    ``W[i, j] = 1 / (1 + max(d_i, d_j))`` for every edge and ``W[i, i] = 1 - sum_j W[i, j]``.
    The result is symmetric, nonnegative and doubly stochastic for any graph, which is
    what makes gossip averaging converge to the exact mean.

    Args:
        graph: Undirected graph whose nodes are the integers ``0..P-1``.

    Returns:
        A ``(P, P)`` float64 array.
    """
    size = graph.number_of_nodes()
    degree = dict(graph.degree())
    weights = np.zeros((size, size), dtype=np.float64)
    for i, j in graph.edges():
        if i == j:
            continue  # a self-loop carries no information between peers
        weights[i, j] = weights[j, i] = 1.0 / (1.0 + max(degree[i], degree[j]))
    # Off-diagonals are at most 1/(1+d_i) each, so the diagonal stays >= 1/(1+d_i) > 0.
    weights[np.diag_indices(size)] = 1.0 - weights.sum(axis=1)
    return weights


def second_eigenvalue(weights: np.ndarray) -> float:
    """Second largest absolute eigenvalue of a symmetric mixing matrix (0.0 when P=1).

    Args:
        weights: Symmetric ``(P, P)`` matrix.

    Returns:
        ``|lambda_2|``, the factor by which one gossip step shrinks disagreement.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape[0] < 2:
        return 0.0
    magnitudes = np.sort(np.abs(np.linalg.eigvalsh(weights)))[::-1]
    return float(magnitudes[1])


def spectral_gap(weights: np.ndarray) -> float:
    """Spectral gap ``1 - |lambda_2|`` of a symmetric mixing matrix (1.0 when P=1).

    Args:
        weights: Symmetric ``(P, P)`` matrix.

    Returns:
        A value in ``[0, 1]``: 1 means one step reaches consensus, 0 means never.
    """
    return float(min(1.0, max(0.0, 1.0 - second_eigenvalue(weights))))
