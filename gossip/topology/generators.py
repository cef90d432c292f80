"""Deterministic graph generators, registered by kind in ``GENERATORS``.

Each generator is a pure function ``(n, **params) -> nx.Graph`` on nodes ``0..n-1``.
Use :func:`build` rather than calling them directly: it checks the parameters and
names the offending one in a ConfigError.
"""

from __future__ import annotations

import inspect
import math
import numbers

import networkx as nx

from gossip.errors import TopologyError
from gossip.registry import Registry

GENERATORS: Registry[nx.Graph] = Registry("graph kind")

_ER_MAX_TRIES = 100


def _empty(n: int) -> nx.Graph:
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    return graph


def _positive_int(kind: str, name: str, value) -> int:
    # bool is an int subclass; "rows: true" is a typo, not a size.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise TopologyError(f"{kind}: {name} must be a positive integer, got {value!r}")
    return int(value)


@GENERATORS.register("ring")
def ring(n: int) -> nx.Graph:
    """Cycle ``i ~ i+1 mod n`` (n=1: no edges; n=2: a single edge)."""
    graph = _empty(n)
    graph.add_edges_from((i, (i + 1) % n) for i in range(n) if (i + 1) % n != i)
    return graph


@GENERATORS.register("line")
def line(n: int) -> nx.Graph:
    """Path ``0 - 1 - ... - n-1``."""
    graph = _empty(n)
    graph.add_edges_from((i, i + 1) for i in range(n - 1))
    return graph


@GENERATORS.register("complete")
def complete(n: int) -> nx.Graph:
    """Every pair of peers connected."""
    graph = _empty(n)
    graph.add_edges_from((i, j) for i in range(n) for j in range(i + 1, n))
    return graph


@GENERATORS.register("star")
def star(n: int) -> nx.Graph:
    """Peer 0 at the centre, connected to every other peer."""
    graph = _empty(n)
    graph.add_edges_from((0, i) for i in range(1, n))
    return graph


@GENERATORS.register("exponential")
def exponential(n: int) -> nx.Graph:
    """``i ~ (i + 2^k) mod n`` for every ``2^k < n``, made undirected."""
    graph = _empty(n)
    hop = 1
    while hop < n:
        graph.add_edges_from((i, (i + hop) % n) for i in range(n))
        hop *= 2
    return graph


@GENERATORS.register("torus")
def torus(n: int | None = None, *, rows: int | None = None, cols: int | None = None) -> nx.Graph:
    """2-D wrap-around grid; rank ``r * cols + c`` sits at row r, column c.

    A side of length 1 adds no edges along it and a side of length 2 adds one (the
    wrap-around coincides with the direct link), so there are never self-loops or
    duplicate edges. ``n`` defaults to ``rows * cols`` and must equal it if given; without
    ``rows`` and ``cols`` it is ``near_torus(n)``, the shape an elastic view takes (a run
    with spares drawn by the seed, e.g. ``--churn random:``, has no rows x cols to give).
    """
    if rows is None and cols is None:
        if n is None:
            raise TopologyError("torus: missing parameter 'rows'")  # or n
        return near_torus(_positive_int("torus", "n", n))
    if rows is None or cols is None:
        missing = "cols" if cols is None else "rows"
        raise TopologyError(f"torus: missing parameter {missing!r} (give rows and cols, or "
                            f"neither)")
    rows = _positive_int("torus", "rows", rows)
    cols = _positive_int("torus", "cols", cols)
    if n is None:
        n = rows * cols
    elif n != rows * cols:
        raise TopologyError(f"torus: rows*cols = {rows}x{cols} = {rows * cols} does not match n = {n}")
    graph = _empty(n)
    for r in range(rows):
        for c in range(cols):
            here = r * cols + c
            for there in (r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c):
                if there != here:
                    graph.add_edge(here, there)  # nx.Graph drops the duplicate when a side is 2
    return graph


@GENERATORS.register("erdos_renyi")
def erdos_renyi(n: int, *, p: float, seed: int = 0) -> nx.Graph:
    """G(n, p) random graph, redrawn with ``seed+1, seed+2, ...`` until connected.

    Deterministic for a given ``(n, p, seed)``; gives up after 100 draws.
    """
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise TopologyError(f"erdos_renyi: p must be a probability in [0, 1], got {p!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TopologyError(f"erdos_renyi: seed must be an integer, got {seed!r}")
    for attempt in range(_ER_MAX_TRIES):
        drawn = nx.gnp_random_graph(n, float(p), seed=int(seed) + attempt)
        if nx.is_connected(drawn):
            graph = _empty(n)
            graph.add_edges_from(drawn.edges())
            return graph
    raise TopologyError(
        f"erdos_renyi: no connected graph with n={n}, p={p} in {_ER_MAX_TRIES} draws "
        f"from seed {seed}; raise p"
    )


def near_torus(n: int) -> nx.Graph:
    """A torus at any size (an elastic run's view of n members, spec elastic.md section 5):
    rows x n/rows with rows the largest divisor of n at most sqrt(n), if that is at least
    sqrt(n)/2; else the circulant ``i ~ i±1, i±ceil(sqrt(n))`` (degree 4 at any n)."""
    root = math.sqrt(n)
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    if rows >= root / 2:
        return torus(n, rows=rows, cols=n // rows)
    graph = _empty(n)
    for hop in (1, math.ceil(root)):
        graph.add_edges_from((i, (i + hop) % n) for i in range(n) if (i + hop) % n != i)
    return graph


#: How a generator whose parameters imply its size is evaluated at another size.
RESIZED = {"torus": near_torus}


def build_at(kind: str, n: int, **params) -> nx.Graph:
    """``build`` at ``n`` peers: a kind whose parameters imply another size takes its
    ``RESIZED`` form instead (a torus of other rows and columns)."""
    if size_implied(kind):
        try:
            return build(kind, n, **params)
        except TopologyError:
            return RESIZED[kind](n)
    return build(kind, n, **params)


def size_implied(kind: str) -> bool:
    """Whether ``kind``'s parameters imply its number of peers (torus: rows x cols), so
    ``build`` may be called without ``n``."""
    n = inspect.signature(GENERATORS.get(kind)).parameters["n"]
    return n.default is not inspect.Parameter.empty


def build(kind: str, n: int | None = None, **params) -> nx.Graph:
    """Generate a graph of ``kind`` after checking ``n`` and ``params``.

    Args:
        kind: A registered generator name (see ``GENERATORS.names()``).
        n: Number of nodes; may be omitted when the parameters imply it (torus).
        **params: Generator parameters, e.g. ``rows`` and ``cols`` for a torus.

    Returns:
        A graph on nodes ``0..n-1``.

    Raises:
        ConfigError: Unknown kind (listing the kinds), or a missing, unexpected or
            invalid parameter (naming it).
    """
    factory = GENERATORS.get(kind)
    signature = inspect.signature(factory).parameters
    accepted = [name for name in signature if name != "n"]
    for name in params:
        if name not in accepted:
            raise TopologyError(
                f"{kind}: unexpected parameter {name!r} (accepted: {', '.join(accepted) or 'none'})"
            )
    for name in accepted:
        if name not in params and signature[name].default is inspect.Parameter.empty:
            raise TopologyError(f"{kind}: missing parameter {name!r}")
    if n is None:
        if signature["n"].default is inspect.Parameter.empty:
            raise TopologyError(f"{kind}: missing parameter 'n' (number of peers)")
    else:
        n = _positive_int(kind, "n", n)
    return factory(n, **params)
