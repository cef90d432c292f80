"""Who attacks, with what: ``Attack`` (one attacking peer's) and ``Attacks`` (a run's, the
``attack`` field of TrainConfig, the ``--attack RANK:KIND[,KEY=VALUE...]`` flags).

Accepted forms of a run's attacks (YAML, ``TrainConfig(attack=...)``)::

    attack: "1:signflip"                             # one flag's text
    attack: ["1:gaussian,sigma=0.5", "3:stale,k=2"]  # several
    attack: {1: alie, 3: {kind: ipm, epsilon: 0.5, seed: 7}}
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from gossip.attacks.kinds import ATTACKS, AttackKind
from gossip.errors import ConfigError

FLAG = "RANK:KIND[,KEY=VALUE...]"


def kind_named(name: str, params: Mapping[str, Any], *, source: str = "attack") -> AttackKind:
    """The attack kind ``name`` with ``params``; ConfigError naming an unknown kind or
    parameter, or a bad value."""
    try:
        cls = ATTACKS.get(name)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    unknown = [key for key in params if key not in cls.names()]
    if unknown:
        known = ", ".join(cls.names()) or "none"
        raise ConfigError(f"{source}: attack {name!r} has no parameter {unknown[0]!r} "
                          f"(parameters: {known})")
    try:
        return cls(**params)
    except ConfigError as exc:
        raise ConfigError(f"{source}: attack {name}: {exc}") from None


def refusal(kind: AttackKind, strategy: str, capabilities: Mapping[str, Any]) -> str | None:
    """Why ``kind`` cannot attack a strategy with these capabilities (None: it can)."""
    if capabilities["operates_on"] != "params" or capabilities["needs_every_peer"]:
        return (f"attack {kind.name}: strategy {strategy} does not send its model to its "
                f"neighbours; attacks need a gossip strategy (dpsgd, matcha)")
    if kind.needs == "neighbours" and not (capabilities["synchronous"]
                                           and capabilities["symmetric_exchange"]):
        return (f"attack {kind.name}: it waits for the round's model of each neighbour it "
                f"sends to, which only symmetric gossip in rounds sends back (synchronous, "
                f"symmetric_exchange); strategy {strategy} does not")
    return None


@dataclass(frozen=True)
class Attack:
    """What one attacking peer does (``Peer(attack=...)``).

    Attributes:
        kind: The attack kind with its parameters (``Attack.named("gaussian", sigma=0.5)``).
        seed: Seeds its random draws.
        attackers: Every attacking rank of the run (its colluders and itself): they never
            wait for each other, and the dissensus attack divides by their weights.
        oracle: Where a rushing attack reads the round's honest models (``models(kind,
            round, destinations)``: theirs and their honest neighbours'); None: from what
            its destinations send it (gossip/attacks/sender.py). The simulator has one.
    """

    kind: AttackKind
    seed: int = 0
    attackers: frozenset[int] = frozenset()
    oracle: Any = field(default=None, compare=False)

    @classmethod
    def named(cls, kind: str, *, seed: int = 0, attackers=(), **params: Any) -> Attack:
        return cls(kind_named(kind, params), seed=seed, attackers=frozenset(attackers))

    def resolved(self, rank: int, size: int) -> Attack:
        """Checked against a run of ``size`` peers where ``rank`` attacks, with defaults that
        depend on the run filled in."""
        attackers = self.attackers | {rank}
        outside = sorted(r for r in attackers if not 0 <= r < size)
        if outside:
            raise ConfigError(f"attack: rank {outside[0]} is not in the run (ranks "
                              f"0..{size - 1})")
        return dataclasses.replace(self, kind=self.kind.resolved(size, len(attackers)),
                                   attackers=frozenset(attackers))


@dataclass(frozen=True)
class Attacks:
    """A run's attackers: ``{rank: (kind, seed or None)}``; None seeds with the run's."""

    by_rank: Mapping[int, tuple[AttackKind, int | None]] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: Any, *, source: str = "attack") -> Attacks:
        """From any accepted form (module doc); ConfigError naming what is wrong."""
        if isinstance(value, Attacks):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            entries = {}
            for text in value:
                rank, entry = _flag(text, source)
                if rank in entries:
                    raise ConfigError(f"{source}: rank {rank} is given two attacks")
                entries[rank] = entry
            value = entries
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: expected {FLAG} or a mapping rank -> kind, "
                              f"got {value!r}")
        return cls({_rank(source, rank): _entry(f"{source}[{rank}]", entry)
                    for rank, entry in value.items()})

    def __bool__(self) -> bool:
        return bool(self.by_rank)

    @property
    def rushing(self) -> bool:
        """Whether an attacker reads the round's honest models before it sends."""
        return any(kind.needs == "neighbours" for kind, _ in self.by_rank.values())

    def for_rank(self, rank: int, *, seed: int) -> Attack | None:
        """``rank``'s attack (None: it is honest); ``seed`` unless the entry has its own."""
        if rank not in self.by_rank:
            return None
        kind, own_seed = self.by_rank[rank]
        return Attack(kind, seed=seed if own_seed is None else own_seed,
                      attackers=frozenset(self.by_rank))

    def check(self, size: int | None, strategy: str,
              capabilities: Mapping[str, Any] | None) -> None:
        """Raise ConfigError if an attacker is not among ``size`` ranks, or its attack does
        not fit the strategy (capabilities None: a factory, checked when built)."""
        for rank, (kind, _) in sorted(self.by_rank.items()):
            if size is not None:
                Attack(kind, attackers=frozenset(self.by_rank)).resolved(rank, size)
            why = capabilities and refusal(kind, strategy, capabilities)
            if why:
                raise ConfigError(why)

    def to_dict(self) -> dict[int, dict[str, Any]]:
        """The mapping form (YAML round trip)."""
        out = {}
        for rank, (kind, seed) in sorted(self.by_rank.items()):
            entry = {"kind": kind.name, **dataclasses.asdict(kind)}
            if seed is not None:
                entry["seed"] = seed
            out[rank] = entry
        return out


def _rank(source: str, key: Any) -> int:
    if isinstance(key, str) and key.strip().isdigit():
        key = int(key)
    if not isinstance(key, numbers.Integral) or isinstance(key, bool) or key < 0:
        raise ConfigError(f"{source}: {key!r} is not a rank")
    return int(key)


def _flag(text: Any, source: str) -> tuple[int, Mapping[str, Any]]:
    """``"3:gaussian,sigma=0.5"`` -> ``(3, {"kind": "gaussian", "sigma": 0.5})``."""
    if not isinstance(text, str):
        raise ConfigError(f"{source}: expected {FLAG}, got {text!r}")
    rank, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ConfigError(f"{source} {text!r}: expected {FLAG}, e.g. 1:signflip")
    kind, *pairs = rest.split(",")
    entry: dict[str, Any] = {"kind": kind.strip()}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{source} {text!r}: expected KEY=VALUE, got {pair!r}")
        entry[key.strip()] = yaml.safe_load(value)
    return _rank(f"{source} {text!r}", rank), entry


def _entry(source: str, entry: Any) -> tuple[AttackKind, int | None]:
    """``"alie"`` or ``{kind: alie, z: 1, seed: 3}`` -> (kind, seed)."""
    if isinstance(entry, str):
        entry = {"kind": entry}
    if not isinstance(entry, Mapping) or not isinstance(entry.get("kind"), str):
        raise ConfigError(f"{source}: expected a kind ({', '.join(ATTACKS.names())}) or a "
                          f"mapping with one, got {entry!r}")
    params = {k: v for k, v in entry.items() if k not in ("kind", "seed")}
    seed = entry.get("seed")
    if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
        raise ConfigError(f"{source}: seed: expected an integer, got {seed!r}")
    return kind_named(entry["kind"], params, source=source), seed
