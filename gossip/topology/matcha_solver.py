"""MATCHA's two optimisation problems over a matching decomposition (Wang et al., arXiv
1905.09435): the activation probabilities p_j maximising the algebraic connectivity of the
expected Laplacian under a communication budget (an SDP, solved by a log-barrier method), and
the mixing weight alpha minimising ``rho = ||E[W^T W] - J||_2`` for ``W(k) = I - alpha L(k)``
(golden-section search). matcha.py turns their results into a plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import linalg

from gossip.topology.matchings import Matching

# Barrier method: stop once the duality gap bound nu/tau is below this (objective accuracy).
_GAP = 1e-9
# Barrier weight growth per centring: fewer centrings vs more Newton steps each.
_TAU_GROWTH = 16.0
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def matching_laplacians(size: int, matchings: Sequence[Matching]) -> np.ndarray:
    """``[M, P, P]`` Laplacians of the matchings (each has eigenvalues 0 and 2)."""
    out = np.zeros((len(matchings), size, size))
    for j, matching in enumerate(matchings):
        for a, b in matching:
            out[j, a, a] += 1.0
            out[j, b, b] += 1.0
            out[j, a, b] -= 1.0
            out[j, b, a] -= 1.0
    return out


def _complement_basis(size: int) -> np.ndarray:
    """Orthonormal ``P x (P-1)`` basis of the vectors orthogonal to the all-ones vector."""
    # QR of [1, e_0, ..., e_{P-2}] (full rank): the first column is along 1, the rest span 1-perp.
    q, _ = np.linalg.qr(np.column_stack([np.ones(size), np.eye(size)[:, : size - 1]]))
    return q[:, 1:]


def optimal_probabilities(laplacians: np.ndarray, total: float) -> np.ndarray:
    """Maximise ``lambda_2(sum_j p_j L_j)`` s.t. ``sum_j p_j <= total``, ``0 <= p_j <= 1``.

    ``lambda_2`` of a Laplacian is the smallest eigenvalue on the complement of the ones
    vector, a concave function of p; the problem is the SDP ``max t s.t.
    sum_j p_j A_j - t I >= 0`` (``A_j`` = ``L_j`` restricted to that complement), solved by a
    log-barrier interior-point method with damped Newton steps to a duality gap below
    1e-9. At ``total >= M`` every ``p_j = 1`` is optimal (``lambda_2`` is monotone in p).
    """
    count, size = laplacians.shape[0], laplacians.shape[1]
    if count == 0 or total >= count:
        return np.ones(count)
    basis = _complement_basis(size)
    reduced = np.einsum("pi,mpq,qj->mij", basis, laplacians, basis)
    dim = size - 1
    p = np.full(count, 0.5 * total / count)
    t = np.linalg.eigvalsh(np.tensordot(p, reduced, axes=1))[0] - 1.0
    z = np.append(p, t)
    nu = dim + 2 * count + 1  # barrier parameter: bounds the gap by nu / tau
    tau = 1.0
    while True:
        z = _centre(z, tau, reduced, total)
        if nu / tau < _GAP:
            break
        tau *= _TAU_GROWTH
    return np.clip(z[:count], 0.0, 1.0)


def _barrier_parts(z: np.ndarray, reduced: np.ndarray, total: float):
    """Gradient and Hessian of the barrier, or None outside its domain."""
    count = reduced.shape[0]
    p, t = z[:count], z[count]
    slack = total - p.sum()
    if np.any(p <= 0.0) or np.any(p >= 1.0) or slack <= 0.0:
        return None
    f = np.tensordot(p, reduced, axes=1) - t * np.eye(reduced.shape[1])
    try:
        chol = np.linalg.cholesky(f)
    except np.linalg.LinAlgError:
        return None
    # K_i = R^-1 F_i R^-T: -log det F has gradient -tr(K_i) and Hessian <K_i, K_j>.
    dim = reduced.shape[1]
    mats = np.concatenate([reduced, -np.eye(dim)[None]], axis=0)  # [M+1, d, d]
    # Two triangular solves on the matrices side by side: R^-1 F_i, then R^-1 (R^-1 F_i)^T.
    half = linalg.solve_triangular(chol, mats.transpose(1, 0, 2).reshape(dim, -1), lower=True)
    half = half.reshape(dim, len(mats), dim).transpose(2, 1, 0).reshape(dim, -1)
    ks = linalg.solve_triangular(chol, half, lower=True).reshape(dim, len(mats), dim)
    ks = ks.transpose(1, 0, 2)
    flat = ks.reshape(len(ks), -1)
    grad = -np.einsum("kii->k", ks)
    hess = flat @ flat.T
    # Bounds 0 < p < 1 and the budget sum(p) < total.
    grad[:count] += -1.0 / p + 1.0 / (1.0 - p) + 1.0 / slack
    hess[:count, :count] += np.diag(1.0 / p**2 + 1.0 / (1.0 - p) ** 2) + 1.0 / slack**2
    return grad, hess


def _centre(z: np.ndarray, tau: float, reduced: np.ndarray, total: float) -> np.ndarray:
    """Minimise ``-tau t + barrier`` by damped Newton steps (self-concordant: the step
    ``1 / (1 + decrement)`` stays feasible, a full step converges quadratically)."""
    count = reduced.shape[0]
    previous = math.inf
    parts = _barrier_parts(z, reduced, total)
    for _ in range(100):
        grad, hess = parts
        grad = grad.copy()
        grad[count] -= tau
        scale = 1.0 / np.sqrt(np.diag(hess))  # Jacobi scaling: entries reach 1/p^2
        step = -scale * np.linalg.solve(hess * scale[:, None] * scale[None, :], grad * scale)
        decrement = math.sqrt(max(float(-grad @ step), 0.0))
        # Close enough to the central path, or stalled on rounding (which grows with tau).
        if decrement < 1e-8 or (decrement < 1e-4 and decrement > 0.5 * previous):
            break
        previous = decrement
        size = 1.0 if decrement < 0.25 else 1.0 / (1.0 + decrement)
        while (trial := _barrier_parts(z + size * step, reduced, total)) is None:
            size *= 0.5  # only rounding can leave the domain
            if size < 1e-12:
                return z
        z, parts = z + size * step, trial
    return z


def expected_matrices(laplacians: np.ndarray, probabilities: np.ndarray):
    """``(L_bar, V)``: mean ``sum p_j L_j`` and variance part ``sum p_j (1 - p_j) L_j``."""
    mean = np.tensordot(probabilities, laplacians, axes=1)
    var = np.tensordot(probabilities * (1.0 - probabilities), laplacians, axes=1)
    return mean, var


def gram(alpha: float, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """``E[W^T W] = I - 2 alpha L_bar + alpha^2 (L_bar^2 + 2 V)`` (uses ``L_j^2 = 2 L_j``)."""
    size = mean.shape[0]
    return np.eye(size) - 2.0 * alpha * mean + alpha**2 * (mean @ mean + 2.0 * var)


def rho(alpha: float, mean: np.ndarray, var: np.ndarray) -> float:
    """``||E[W^T W] - J||_2`` at ``alpha``."""
    size = mean.shape[0]
    eig = np.linalg.eigvalsh(gram(alpha, mean, var) - np.full((size, size), 1.0 / size))
    return float(max(abs(eig[0]), abs(eig[-1])))


def optimal_alpha(mean: np.ndarray, var: np.ndarray) -> tuple[float, float]:
    """``(alpha, rho)`` minimising ``rho(alpha)`` over ``alpha >= 0``.

    ``E[W^T W] - J`` is PSD (it is ``E[W^T W]`` on the complement of the ones vector and 0 on
    it), so its norm is its largest eigenvalue: a maximum of convex quadratics in alpha,
    hence convex, and the same optimum as the spec's SDP (whose ``b = a^2`` at optimum).
    ``rho(0) = 1`` and ``rho(alpha) >= (1 - alpha lambda_max)^2 >= 1`` beyond
    ``2 / lambda_max``, so golden-section search on that bracket finds the minimum.
    """
    size = mean.shape[0]
    if size < 2:
        return 0.0, 0.0
    top = float(np.linalg.eigvalsh(mean)[-1])
    if top <= 0.0:
        return 0.0, rho(0.0, mean, var)
    lo, hi = 0.0, 2.0 / top
    x1, x2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    f1, f2 = rho(x1, mean, var), rho(x2, mean, var)
    while hi - lo > 1e-13 * (1.0 + hi):
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - _GOLDEN * (hi - lo)
            f1 = rho(x1, mean, var)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + _GOLDEN * (hi - lo)
            f2 = rho(x2, mean, var)
    alpha = x1 if f1 <= f2 else x2
    return float(alpha), float(min(f1, f2))
