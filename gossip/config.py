"""The resolved configuration of a training run: frozen, validated, YAML round-trippable."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gossip.attacks import Attacks
from gossip.errors import ConfigError
from gossip.faults import DelayConfig
from gossip.matrix import check_run
from gossip.overlap import DEFAULT_BUCKET_MB
from gossip.strategies import DEFAULT, STRATEGIES
from gossip.options import Check, Options, at_least, option
from gossip.tasks import SCHEMES, factory_labelled, task_factory
from gossip.transport import DEAD_AFTER_S, TIMEOUT_S


def _rule(allowed: Callable[[Any], bool], why: str) -> Check:
    """A check refusing, with ``why``, the values ``allowed`` is false for."""
    return lambda value: None if allowed(value) else why


def _scheme(value: str) -> str | None:
    return None if value in SCHEMES else f"must be one of {', '.join(SCHEMES)}"


@dataclass(frozen=True)
class TrainConfig(Options):
    """What every peer of a run trains and how it synchronizes.

    Each field is declared once, with its default, doc and check (``describe()`` lists
    them); `gossip peer`, `launch` and `simulate` generate their flags from the scalar ones
    (gossip/cli/flags.py). The strategy and its options are parsed once, into ``spec``.
    """

    strategy: str = option("", "Synchronization strategy, e.g. dpsgd, ring-allreduce "
                               "(empty: the default one).")
    options: Mapping[str, Any] = option({}, "Strategy options (e.g. piece_bytes).")
    task: str = option("digits", "Task: digits, deep-mlp, resnet, gpt, or "
                                 "package.module:factory.")
    rounds: int = option(300, "Optimizer steps per peer; each one synchronizes once.",
                         check=at_least(1))
    batch_size: int = option(32, "Samples per local step (per peer and round).",
                             check=at_least(1))
    minibatches: int = option(
        1, "Split each batch into this many equal mini-batches whose gradients are "
           "accumulated (delays are injected per mini-batch; nonblocking may stop a round "
           "early).", check=at_least(1))
    lr: float = option(0.1, "SGD learning rate (0: no training step, the peers only mix "
                            "their models: pure gossip).",
                       check=_rule(lambda v: v >= 0, "must be >= 0 (0: pure gossip)"))
    momentum: float = option(0.9, "SGD momentum (local to each peer).",
                             check=_rule(lambda v: 0 <= v < 1, "must be in [0, 1)"))
    partition: str = option("iid", "Data split over peers: iid or dirichlet.", check=_scheme)
    alpha: float = option(0.5, "Dirichlet concentration (smaller is more skewed).",
                          check=_rule(lambda v: v > 0, "must be > 0"))
    seed: int = option(0, "Seeds data split, model init and batches; equal on all peers.")
    eval_every: int = option(25, "Rounds between consensus measurements (and at the last "
                                 "round).", check=at_least(1))
    test_every: int = option(1, "Rounds between the test-set scores of each peer's model "
                                "(accuracy, and loss and perplexity where the task has them) "
                                "in its records (and at the last round); the others leave "
                                "them empty. Scoring costs compute: a larger model's run "
                                "spends less time on it.", check=at_least(1))
    timeout: float = option(
        TIMEOUT_S, "Seconds to wait for a peer's message (ps and adpsgd wait as long as the "
                   "peer is alive: until this long without a message or a heartbeat).",
        check=_rule(lambda v: v > 0, "must be > 0"))
    dead_after: float = option(
        DEAD_AFTER_S, "Declare a peer dead once its connection stayed broken this many seconds "
                      "(gossip drops it, all-reduce stops naming it); keep it below timeout.",
        check=_rule(lambda v: v > 0, "must be > 0"))
    elastic: bool = option(
        False, "Survive deaths: the survivors agree on a view of the members without the dead "
               "peer and go on, every model bitwise equal (all-reduce strategies that declare "
               "survives_death, e.g. ring-allreduce); gossip strategies that declare "
               "mixes_on_views (dpsgd) rebuild their graph on each view; others refuse it.")
    min_peers: int = option(1, "With elastic: fewer peers left than this end the run.",
                            check=at_least(1))
    spares: int = option(0, "With elastic: the topology's last this many ranks are not members "
                            "at first; a peer started on one with join joins the run (with a "
                            "rendezvous: ids after the launcher's peers, given by its store).",
                         check=_rule(lambda v: v >= 0, "must be >= 0"))
    join: bool = option(False, "With elastic, on a spare rank (with a rendezvous: the store "
                               "gives a fresh id): join the running members, starting from "
                               "a donor's state.")
    checkpoint_every: int = option(
        0, "Write each peer's checkpoint every this many rounds (0: never); a peer restarted "
           "with `gossip peer --resume` rejoins from it (every peer then keeps its last "
           "messages per neighbour to re-send them).",
        check=_rule(lambda v: v >= 0, "must be >= 0 (0: no checkpoints)"))
    delays: DelayConfig = option(DelayConfig(), "Injected compute, straggler and send delays "
                                                "(gossip.faults).")
    task_options: Mapping[str, Any] = option({}, "Keyword arguments of the task's factory "
                                                 "(e.g. width, depth of deep-mlp).")
    layer_delay: float = option(
        0.0, "Emulated device: each layer sleeps this many seconds in forward, twice in "
             "backward (gossip.tasks.emulated); 0: off.",
        check=_rule(lambda v: v >= 0, "must be >= 0"))
    overlap: bool = option(False, "Overlap synchronization with forward/backward "
                                  "(Peer.attach).")
    bucket_mb: float = option(DEFAULT_BUCKET_MB, "With overlap: gradient bucket size in MiB "
                                                 "(.inf: one bucket).",
                              check=_rule(lambda v: v > 0, "must be > 0 (MiB)"))
    budget_samples: int = option(
        0, "Asynchronous strategies: a peer also stops after this many samples (0: no limit; "
           "rounds always bounds it).", check=_rule(lambda v: v >= 0, "must be >= 0 (0: no limit)"))
    budget_seconds: float = option(
        0.0, "Asynchronous strategies: a peer also stops after this many seconds of training "
             "(0: no limit).", check=_rule(lambda v: v >= 0, "must be >= 0 (0: no limit)"))
    snapshot_seconds: float = option(
        2.0, "Asynchronous strategies: each peer saves its model every this many seconds of "
             "wall clock, for the consensus (gossip.snapshots); 0: no snapshots.",
        check=_rule(lambda v: v >= 0, "must be >= 0 (0: no snapshots)"))
    attack: Attacks = option(Attacks(), "Attacking peers (gossip.attacks): RANK:KIND[,KEY=VALUE"
                                        "...] strings, or a mapping (experiments only).")

    @classmethod
    def refusal(cls, name: str, value: Any, why: str) -> ConfigError:
        """Errors as a run's config writes them: ``rounds: 0 must be >= 1``."""
        return ConfigError(f"{name}: {value!r} {why}")

    def __post_init__(self):
        super().__post_init__()  # every field's type and check
        if not self.strategy:
            object.__setattr__(self, "strategy", DEFAULT)
        # The name and every option checked, once: everything downstream uses the spec.
        object.__setattr__(self, "spec", STRATEGIES.resolve(self.strategy, self.options))
        self.check_labels(task_factory(self.task))
        if self.batch_size % self.minibatches:
            raise self.refusal("batch_size", self.batch_size,
                               f"must be a multiple of minibatches ({self.minibatches})")
        if (self.join or self.spares) and not self.elastic:
            raise self.refusal("join" if self.join else "spares", True if self.join else
                               self.spares, "needs elastic (joins run on agreed views)")
        check_run(self)  # overlap, budgets and checkpoints against the strategy

    def check_labels(self, factory: Callable) -> None:
        """Refuse what needs class labels (a dirichlet partition, label flipping) for a
        task whose examples have none (a language model's)."""
        if factory_labelled(factory):
            return
        if self.partition != "iid":
            raise self.refusal("partition", self.partition,
                               f"splits by class label, and task {self.task}'s examples have "
                               f"none (use iid)")
        for rank, (kind, _) in self.attack.by_rank.items():
            if kind.needs_labels:
                raise self.refusal("attack", f"{rank}:{kind.name}",
                                   f"changes class labels, and task {self.task}'s examples "
                                   f"have none")

    @property
    def asynchronous(self) -> bool:
        """Whether the strategy runs without lockstep rounds: each peer counts its own steps
        (``Strategy.synchronous`` false)."""
        return not self.spec.capabilities()["synchronous"]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["options"] = dict(self.options)
        data["task_options"] = dict(self.task_options)
        data["delays"] = self.delays.to_dict()
        data["attack"] = self.attack.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> TrainConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"{source}: unknown field {key!r}; fields: {', '.join(known)}")
        values = {}
        for key, value in data.items():
            default = known[key].default
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ConfigError(f"{source}: {key}: expected a number, got {value!r}")
                value = type(default)(value)
            values[key] = value
        try:
            if "delays" in values:
                values["delays"] = DelayConfig.from_dict(values["delays"])
            if "attack" in values:
                values["attack"] = Attacks.parse(values["attack"])
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        data = load_yaml(path)
        return cls.from_dict(data.get("train", data), source=str(path))


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from ``path``; errors name the file (and line)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data

