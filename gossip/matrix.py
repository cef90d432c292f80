"""The compatibility matrix: every strategy against every mode, computed from capabilities.

Each mode (a ``Feature``) states what it needs of a strategy's capabilities; each strategy
states what it has (``Strategy.capabilities_for``). A cell is one ``Feature.needs`` call,
and ``check`` runs the cells of a run's modes (and the pairs of modes that exclude each
other) before any socket opens: ``Peer(...)``, ``TrainConfig`` (overlap, budgets,
checkpoints), `gossip peer`, `gossip launch`, `gossip simulate`, ``launch_run``,
``simulate_run`` and experiments. `gossip strategies --matrix`, docs/MATRIX.md and
tests/integration/test_matrix.py are all generated from the same tables, so a new strategy
or mode joins them with no edit there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gossip.errors import ConfigError
from gossip.strategies import STRATEGIES
from gossip.strategies.wrapping import wrapped

Capabilities = Mapping[str, Any]


@dataclass(frozen=True)
class Feature:
    """One mode a run may use, and what it needs of the strategy."""

    name: str
    #: What the user sets to get it (how errors name it), e.g. ``overlap: True``.
    flag: str
    #: Why a strategy with these capabilities cannot run in this mode (None: it can).
    needs: Callable[[Capabilities], str | None]
    #: Being wrapped: the wrapper strategy's registered name.
    wrapper: str | None = None


def _overlap(held: Capabilities) -> str | None:
    if held.get("stops_rounds_early"):
        return ("it decides at run time when a round's computation ends (stops_rounds_early), "
                "so there is no fixed point to start its communication at")
    if held.get("plans_rounds"):
        return ("it plans each round (local steps between averages, warm-up, optimizer "
                "state at an average), which overlap's every-round mixing would override; "
                "it already sends only in its averaging rounds: train it without overlap")
    if held.get("synchronous") is False:
        return "it is asynchronous: its exchanges already run between mini-batches"
    return None


def _lockstep(what: str) -> Callable[[Capabilities], str | None]:
    def needs(held: Capabilities) -> str | None:
        if held.get("synchronous") is False:
            return f"it is asynchronous (no lockstep rounds), and {what}"
        return None
    return needs


def _asynchronous(held: Capabilities) -> str | None:
    if held.get("synchronous") is not False:
        return ("it runs in lockstep rounds, so every peer must run the same rounds (give "
                "rounds); budgets in samples or seconds need an asynchronous strategy")
    return None


def _roles(held: Capabilities) -> str | None:
    if not held.get("serves_roles"):
        return ("it has no server role (serves_roles): its rounds need every rank of the "
                "graph, and a rank of servers: would only serve, so the others would wait "
                "for it until their timeout; use a strategy that serves, e.g. ps")
    return None


def _elastic(held: Capabilities) -> str | None:
    if not held.get("survives_death") and not held.get("mixes_on_views"):
        return ("it cannot run on agreed views of the members (neither survives_death nor "
                "mixes_on_views): gossip: use dpsgd without staleness or robust; all-reduce: "
                "ring-allreduce without a compressor, topk-allgather without robust, gtopk "
                "or spardl")
    return None


def _anything(held: Capabilities) -> str | None:
    return None


#: The modes, in the matrix's column order (wrappers follow: ``wrappers()``).
FEATURES: tuple[Feature, ...] = (
    Feature("overlap", "overlap: True", _overlap),
    Feature("simulate", "gossip simulate", _anything),
    Feature("roles", "servers: (topology roles)", _roles),
    Feature("rendezvous", "--rendezvous", _anything),
    Feature("budgets", "budget_samples/budget_seconds", _asynchronous),
    Feature("arbiter", "--arbiter (shared device)",
            _lockstep("the shared device's turns are rounds of lockstep training")),
    Feature("checkpoint", "checkpoint_every",
            _lockstep("a resumed job restarts at a round every peer reached")),
    Feature("cuda", "CUDA tensors", _anything),
    Feature("elastic", "--elastic", _elastic),
)

#: Pairs of modes that exclude each other whatever the strategy: (refused, in), why.
CONFLICTS: dict[tuple[str, str], str] = {
    ("overlap", "simulate"): (
        "not simulated: overlap communicates on a thread of its own, and the simulator runs "
        "every peer on one OS thread in virtual time (use gossip launch, or no overlap)"),
    ("checkpoint", "simulate"): "checkpoints and rejoins are not simulated (set it to 0)",
    ("arbiter", "simulate"): ("not simulated: the simulator models compute in virtual time, "
                              "there is no device to share"),
    ("overlap", "elastic"): ("not with overlap yet: a bucket's round would be adopted or "
                             "redone apart from the others'"),
    ("checkpoint", "elastic"): ("not with checkpoints yet: a restarted peer's rejoin does not "
                                "know the views agreed meanwhile"),
}


def wrappers() -> list[Feature]:
    """Being wrapped by each registered wrapper strategy (capability ``wraps``: its options
    class decides ``accepts_inner``), as a mode."""
    return [Feature(f"in {name}", f"{name}: inner",
                    STRATEGIES.entry(name).options.accepts_inner, wrapper=name)
            for name in STRATEGIES.where(wraps=True)]


def features() -> list[Feature]:
    """Every column of the matrix: the modes, then the wrappers."""
    return [*FEATURES, *wrappers()]


def feature(name: str) -> Feature:
    for one in features():
        if one.name == name:
            return one
    raise ConfigError(f"no mode {name!r}; modes: {', '.join(f.name for f in features())}")


def capabilities(strategy, options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """What ``strategy`` (a registered name, a Strategy class with ``options``, or a spec
    ``STRATEGIES.resolve`` returned) can do; None for a factory, which is built only later."""
    return STRATEGIES.resolve(strategy, options).capabilities()


def label(strategy, options: Mapping[str, Any] | None = None) -> str:
    """How the table names a strategy: ``local[dpsgd]`` for a wrapper and its inner, then
    a wrapper's own options if any (a variant's)."""
    if not isinstance(strategy, str):
        return getattr(strategy, "__name__", "factory")
    inner = wrapped(strategy, options) if options else None  # defaults: the name alone
    if inner is None:
        return strategy
    own = "".join(f" {key}={value}" for key, value in inner.own.items())
    return f"{strategy}[{label(inner.inner, inner.inner_options)}]{own}"


def check(strategy, options: Mapping[str, Any] | None, modes: Iterable[str]) -> None:
    """Refuse at start what cannot work: ``strategy`` with ``options`` in all of ``modes``.

    Raises:
        ConfigError: one line naming the mode (or pair of modes), the strategy and why.
    """
    modes = sorted(set(modes))
    for (refused, within), why in CONFLICTS.items():
        if refused in modes and within in modes:
            raise ConfigError(f"{feature(refused).flag}: {why}")
    spec = STRATEGIES.resolve(strategy, options)
    held = spec.capabilities()
    if held is None:
        return
    for mode in modes:
        one = feature(mode)
        why = one.needs(held)
        if why:
            raise ConfigError(f"{one.flag} with strategy {spec.name}: {why}")


def run_modes(config, topology=None, **more: bool) -> set[str]:
    """The modes a run of ``config`` (a TrainConfig) on ``topology`` uses; ``more`` adds
    those its entry knows (``simulate``, ``rendezvous``, ``arbiter``)."""
    modes = {name for name, used in more.items() if used}
    if config.overlap:
        modes.add("overlap")
    if config.budget_samples or config.budget_seconds:
        modes.add("budgets")
    if config.checkpoint_every:
        modes.add("checkpoint")
    if config.elastic:
        modes.add("elastic")
    return modes | topology_modes(topology)


def topology_modes(topology) -> set[str]:
    """The modes ``topology`` implies: ``roles`` where some rank only serves (ranks that
    both train and serve leave every rank in the strategy's rounds)."""
    roles = getattr(topology, "roles", None)
    return {"roles"} if roles is not None and len(roles.workers) < topology.size else set()


def check_run(config, topology=None, **more: bool) -> None:
    """``check`` for a run of ``config`` on ``topology`` (see ``run_modes``)."""
    check(config.spec, None, run_modes(config, topology, **more))
    config.attack.check(topology.size if topology is not None else None,
                        config.spec.name, config.spec.capabilities())


# -- the table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One strategy of the matrix: a registered name, or a wrapper with one inner."""

    strategy: str
    options: Mapping[str, Any]

    @property
    def label(self) -> str:
        return label(self.strategy, self.options)


def rows() -> list[Row]:
    """Every registered strategy with its default options and its ``variants``, then each
    wrapper with each inner strategy it accepts (with the inner's defaults), by default
    and in each variant that takes that inner."""
    plain = [Row(name, {}) for name in STRATEGIES.names()]
    inside = [Row(name, dict(variant)) for name in STRATEGIES.names()
              if not STRATEGIES.strategy_class(name).wraps
              for variant in STRATEGIES.entry(name).options.variants]
    for wrapper in wrappers():
        accepted = [row.strategy for row in plain
                    if wrapper.needs(capabilities(row.strategy)) is None]  # itself: never
        inside += [Row(wrapper.wrapper, {"inner": inner}) for inner in accepted]
        for variant in STRATEGIES.entry(wrapper.wrapper).options.variants:
            inside += [Row(wrapper.wrapper, {"inner": inner, **variant}) for inner in accepted
                       if _valid(wrapper.wrapper, {"inner": inner, **variant})]
    return plain + inside


def _valid(strategy: str, options: Mapping[str, Any]) -> bool:
    try:
        STRATEGIES.options(strategy, options)
    except ConfigError:
        return False
    return True


def cell(row: Row, column: Feature) -> str | None:
    """Why ``row`` cannot run in ``column`` (None: it works)."""
    return column.needs(capabilities(row.strategy, row.options))


def markdown() -> str:
    """The matrix as docs/MATRIX.md holds it."""
    columns = features()
    lines = ["# Compatibility matrix", "",
             "Generated by `gossip strategies --matrix` from the strategies' "
             "capabilities and what each mode needs (gossip/matrix.py); "
             "tests/unit/test_matrix_check.py fails when this file differs. `yes`: works "
             "(tests/integration/test_matrix.py runs it); `no (N)`: refused at start with a "
             "one-line ConfigError, reason N below.", "",
             "| strategy | " + " | ".join(c.name for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    reasons: list[str] = []
    for row in rows():
        marks = []
        for column in columns:
            why = cell(row, column)
            if why is None:
                marks.append("yes")
                continue
            if why not in reasons:
                reasons.append(why)
            marks.append(f"no ({reasons.index(why) + 1})")
        lines.append(f"| {row.label} | " + " | ".join(marks) + " |")
    lines += ["", "Columns: " + "; ".join(f"`{c.name}`: {c.flag}" for c in columns) + ".",
              "", "Reasons:", ""]
    lines += [f"{i}. {why}" for i, why in enumerate(reasons, 1)]
    lines += ["", "Modes that exclude each other whatever the strategy:", ""]
    lines += [f"* {a} in {b}: {why}" for (a, b), why in CONFLICTS.items()]
    return "\n".join(lines) + "\n"
