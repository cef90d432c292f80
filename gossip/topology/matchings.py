"""Matching decomposition: a graph's edges split into matchings by a proper edge colouring.

Each matching's pairs can exchange in parallel, so one matching is one unit of communication
time (MATCHA, matcha.py). The colouring is deterministic, so every peer computes the same one
without talking: Delta colours where found (Konig for bipartite graphs, round-robin for even
complete graphs, a bounded search otherwise), Misra-Gries' Delta+1 colours as the fallback.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import networkx as nx

from gossip.errors import TopologyError

Edge = tuple[int, int]
Matching = tuple[Edge, ...]

# Exact Delta-colouring search gives up after this many colour assignments (deterministic,
# unlike a time limit) and falls back to Misra-Gries' Delta+1 colours.
_SEARCH_STEPS = 20_000
_SEARCH_WORK = 5_000_000


def decompose(edges: Iterable[Sequence[int]]) -> tuple[Matching, ...]:
    """Partition ``edges`` into matchings by a proper edge colouring.

    Uses Delta colours (Delta = max degree) when it can prove or find them: always for
    bipartite graphs (Koenig), otherwise by a bounded exact search; else Misra-Gries'
    Delta+1. Deterministic: edges are canonicalised (``a < b``, sorted) first, and the
    result is sorted (pairs within a matching, then matchings lexicographically).

    Raises:
        TopologyError: a self-loop or a duplicate edge.
    """
    canon = canonical_edges(edges)
    if not canon:
        return ()
    size = max(b for _, b in canon) + 1
    degree = [0] * size
    for a, b in canon:
        degree[a] += 1
        degree[b] += 1
    delta = max(degree)
    graph = nx.Graph(canon)
    if nx.is_bipartite(graph):
        colours = _bipartite_colouring(size, canon, delta)
    elif size % 2 == 0 and len(canon) == size * (size - 1) // 2:
        colours = _round_robin(size, canon)
    else:
        colours = None
        # An overfull graph (more edges than Delta matchings can hold) needs Delta+1.
        if len(canon) <= delta * (size // 2):
            steps = min(_SEARCH_STEPS, _SEARCH_WORK // len(canon))  # a step costs O(edges)
            colours = _search_colouring(size, canon, delta, steps)
        if colours is None:
            colours = _misra_gries(size, canon, delta + 1)
    groups: dict[int, list[Edge]] = {}
    for edge, colour in zip(canon, colours):
        groups.setdefault(colour, []).append(edge)
    return tuple(sorted(tuple(sorted(group)) for group in groups.values()))


def canonical_edges(edges: Iterable[Sequence[int]]) -> list[Edge]:
    seen: set[Edge] = set()
    for edge in edges:
        a, b = (int(v) for v in edge)
        if a == b:
            raise TopologyError(f"self-loop on rank {a}")
        key = (min(a, b), max(a, b))
        if key in seen:
            raise TopologyError(f"duplicate edge {key[0]}-{key[1]}")
        seen.add(key)
    return sorted(seen)


def _bipartite_colouring(size: int, edges: list[Edge], delta: int) -> list[int]:
    """Delta colours for a bipartite graph: swap an alternating path when colours clash."""
    at: list[dict[int, int]] = [{} for _ in range(size)]  # vertex -> {colour: neighbour}

    def free(v: int) -> int:
        return next(c for c in range(delta) if c not in at[v])

    for u, v in edges:
        a, b = free(u), free(v)
        if a in at[v]:
            # The a/b path from v cannot reach u in a bipartite graph: swapping it frees a at v.
            _swap_path(at, v, a, b)
        at[u][a], at[v][a] = v, u
    return [next(c for c, w in at[a].items() if w == b) for a, b in edges]


def _round_robin(size: int, edges: list[Edge]) -> list[int]:
    """The complete graph on an even number of vertices: P-1 perfect matchings (circle
    method: vertex P-1 stays put, the others rotate)."""
    colour: dict[Edge, int] = {}
    ring = size - 1
    for r in range(ring):
        colour[(r, ring)] = r
        for i in range(1, size // 2):
            a, b = (r + i) % ring, (r - i) % ring
            colour[(min(a, b), max(a, b))] = r
    return [colour[edge] for edge in edges]


def _swap_path(at: list[dict[int, int]], start: int, first: int, second: int) -> None:
    """Swap colours ``first`` and ``second`` on the maximal path from ``start`` that begins
    with a ``first`` edge and alternates."""
    path, colour, here = [start], first, start
    while colour in at[here]:
        here = at[here][colour]
        path.append(here)
        colour = second if colour == first else first
    colour = first
    pairs = []
    for x, y in itertools.pairwise(path):
        pairs.append((x, y, colour))
        colour = second if colour == first else first
    for x, y, c in pairs:
        del at[x][c], at[y][c]
    for x, y, c in pairs:
        other = second if c == first else first
        at[x][other], at[y][other] = y, x


def _misra_gries(size: int, edges: list[Edge], k: int) -> list[int]:
    """Misra-Gries edge colouring with ``k = Delta + 1`` colours."""
    at: list[dict[int, int]] = [{} for _ in range(size)]

    def free(v: int) -> int:
        return next(c for c in range(k) if c not in at[v])

    def colour_of(x: int, y: int) -> int:
        return next(c for c, w in at[x].items() if w == y)

    for u, v in edges:
        # Maximal fan of u: (u, fan[0]) uncoloured, colour(u, fan[i+1]) free on fan[i].
        fan, in_fan = [v], {v}
        extended = True
        while extended:
            extended = False
            for c in range(k):
                w = at[u].get(c)
                if c not in at[fan[-1]] and w is not None and w not in in_fan:
                    fan.append(w)
                    in_fan.add(w)
                    extended = True
                    break
        c, d = free(u), free(fan[-1])
        if d in at[u]:
            _swap_path(at, u, d, c)  # afterwards d is free on u
        # A fan prefix whose end has d free exists (Misra & Gries 1992).
        end = None
        for i, w in enumerate(fan):
            if i > 0 and colour_of(u, w) in at[fan[i - 1]]:
                break  # the prefix stops being a fan here
            if d not in at[w]:
                end = i
                break
        if end is None:
            raise AssertionError(f"Misra-Gries found no fan end for edge {u}-{v}")
        # Rotate: (u, fan[i]) takes the colour of (u, fan[i+1]); (u, fan[end]) gets d.
        for i in range(end):
            nxt = colour_of(u, fan[i + 1])
            del at[u][nxt], at[fan[i + 1]][nxt]
            at[u][nxt], at[fan[i]][nxt] = fan[i], u
        at[u][d], at[fan[end]][d] = fan[end], u
    return [colour_of(a, b) for a, b in edges]


def _search_colouring(size: int, edges: list[Edge], k: int, max_steps: int) -> list[int] | None:
    """Exact k-edge-colouring by backtracking (most constrained edge first, colours used in
    order of first use to skip symmetric relabellings); None if not found in ``max_steps``."""
    full = (1 << k) - 1
    mask = [0] * size
    colour = [-1] * len(edges)
    stack: list[tuple[int, list[int], int]] = []  # (edge, colours left to try, max used before)
    max_used, steps = -1, 0

    def choose() -> tuple[int, list[int]] | None:
        best, best_avail, best_count = None, 0, k + 1
        allowed = full & ((1 << (max_used + 2)) - 1)
        for e, (a, b) in enumerate(edges):
            if colour[e] < 0:
                avail = allowed & ~(mask[a] | mask[b])
                count = avail.bit_count()
                if count < best_count:
                    best, best_avail, best_count = e, avail, count
                    if not count:
                        break
        if best is None:
            return None
        return best, [c for c in range(k) if best_avail >> c & 1]

    picked = choose()
    if picked is None:
        return []
    stack.append((picked[0], picked[1], max_used))
    while stack:
        e, options, before = stack[-1]
        a, b = edges[e]
        if colour[e] >= 0:  # undo the previous try of this edge
            mask[a] &= ~(1 << colour[e])
            mask[b] &= ~(1 << colour[e])
            colour[e] = -1
        max_used = before
        if not options:
            stack.pop()
            continue
        steps += 1
        if steps > max_steps:
            return None
        c = options.pop(0)
        colour[e] = c
        mask[a] |= 1 << c
        mask[b] |= 1 << c
        max_used = max(before, c)
        picked = choose()
        if picked is None:
            return colour
        stack.append((picked[0], picked[1], max_used))
    return None
