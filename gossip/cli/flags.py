"""The training flags `gossip peer`, `launch` and `simulate` share, and the TrainConfig they
make: one flag per scalar ``TrainConfig`` field, its help and default from the field's
declaration (gossip/config.py), so nothing is restated here.

The flags are made when such a command first needs them (``TrainingCommand``): TrainConfig
imports torch, which takes seconds that `gossip --help` and the other commands do without.
"""

from __future__ import annotations

import dataclasses
import typing

import click

from gossip.cli.common import key_values
from gossip.errors import ConfigError

FLAG_TYPES = {int: int, float: float, str: str}
TOLERATE_HELP = ("Exit 0 even if up to N peers died (the run exits non-zero when a peer it "
                 "did not kill itself died).")  # launch's and simulate's --tolerate-deaths


def field_flags(config=None) -> list[click.Option]:
    """A click option per scalar field of ``config`` (default: TrainConfig), ``--batch-size``
    for ``batch_size``; unset, a flag keeps the config's value (its default shows in the
    help)."""
    if config is None:
        from gossip.config import TrainConfig as config
    hints = typing.get_type_hints(config)
    flags = []
    for spec in dataclasses.fields(config):
        kind = hints[spec.name]
        if kind is not bool and kind not in FLAG_TYPES:
            continue  # a mapping or section: --option, --task-option, the delay flags
        name = "--" + spec.name.replace("_", "-")
        decls = [f"{name}/--no-{name[2:]}"] if kind is bool else [name]
        shown = _shown(spec.default)
        flags.append(click.Option([*decls, spec.name], default=None,
                                  help=spec.metadata["doc"] + (f"  [default: {shown}]"
                                                               if shown else ""),
                                  type=None if kind is bool else FLAG_TYPES[kind]))
    return flags


def _shown(default) -> str:
    """A field's default as the help shows it ("": not shown, e.g. the empty strategy)."""
    if default is dataclasses.MISSING or default == "":
        return ""
    if isinstance(default, bool):
        return str(default).lower()
    return f"{default:g}" if isinstance(default, float) else str(default)


def other_flags() -> list[click.Option]:
    """The training flags that are no TrainConfig field (strategy and task options, delays,
    the shared device, the config file)."""
    from gossip.attacks import ATTACKS
    return [
        click.Option(["--option", "strategy_options"], multiple=True, metavar="KEY=VALUE",
                     help="Strategy option, repeatable (e.g. piece_bytes=1048576)."),
        click.Option(["--compute-delay"], type=float, metavar="SECONDS",
                     help="Emulated compute time slept per mini-batch (a slower device)."),
        click.Option(["--slowdown"], multiple=True, metavar="RANK:FACTOR",
                     help="Rank's mini-batches take FACTOR times as long, repeatable."),
        click.Option(["--straggler-prob"], type=float,
                     help="Probability that a mini-batch is hit by a straggler delay."),
        click.Option(["--straggler-mean"], type=float, metavar="SECONDS",
                     help="Mean of the (exponential) straggler delay."),
        click.Option(["--send-delay"], multiple=True, metavar="[RANK:]SECONDS",
                     help="Sleep before every send: SECONDS for all ranks, or RANK:SECONDS, "
                          "repeatable."),
        click.Option(["--delay-seed"], type=int,
                     help="Seed of the straggler draws (default --seed)."),
        click.Option(["--attack"], multiple=True, metavar="RANK:KIND[,KEY=VALUE...]",
                     help=f"This rank attacks ({', '.join(ATTACKS.names())}), repeatable "
                          "with KEY=VALUE parameters (docs/ARCHITECTURE.md, Attacks)."),
        click.Option(["--arbiter"], metavar="ADDRESS",
                     help="Share each peer's device with other jobs through this arbiter: "
                          "ipc://PATH or tcp://HOST:PORT (`gossip arbiter`), flock:DIR, "
                          "slices:DIR."),
        click.Option(["--device"], metavar="NAME",
                     help="With --arbiter: the device, {rank} replaced by the rank "
                          "(default dev{rank})."),
        click.Option(["--job"], metavar="NAME",
                     help="With --arbiter: this job's name among those sharing the devices "
                          "(turns go by name)."),
        click.Option(["--config", "config_path"], type=click.Path(dir_okay=False),
                     help="YAML with training settings (a run directory's config.yaml)."),
        click.Option(["--task-option", "task_options"], multiple=True, metavar="KEY=VALUE",
                     help="Task factory option, repeatable (e.g. width=1024, depth=8)."),
    ]


class TrainingCommand(click.Command):
    """A command that also takes the training flags (``@main.command(cls=TrainingCommand)``):
    the fields' flags, then the others, after the command's own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flags_made = False

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not self.flags_made:  # every use of the params (parsing, help) asks here first
            self.params.extend([*field_flags(), *other_flags()])
            self.flags_made = True
        return super().get_params(ctx)


def train_config(config_path, strategy_options, *, compute_delay=None, slowdown=(),
                 straggler_prob=None, straggler_mean=None, send_delay=(), delay_seed=None,
                 arbiter=None, device=None, job=None, task_options=(), attack=(), **flags):
    """The TrainConfig of the training flags: ``--config``'s file (if any), each flag given
    on top. ``arbiter``, ``device`` and ``job`` are read by the caller (the shared device)."""
    from gossip.config import TrainConfig

    base = TrainConfig.from_yaml(config_path).to_dict() if config_path else {}
    base.update({k: v for k, v in flags.items() if v is not None})
    delays = dict(base.get("delays") or {})
    for key, value in (("compute", compute_delay), ("straggler_prob", straggler_prob),
                       ("straggler_mean", straggler_mean), ("seed", delay_seed)):
        if value is not None:
            delays[key] = value
    if slowdown:
        delays["slowdown"] = rank_values("--slowdown", slowdown)
    if send_delay:
        if len(send_delay) == 1 and ":" not in send_delay[0]:
            delays["send_delay"] = _float("--send-delay", send_delay[0])
        else:
            delays["send_delay"] = rank_values("--send-delay", send_delay)
    base["delays"] = delays
    if attack:
        base["attack"] = list(attack)
    base["options"] = key_values("--option", base.get("options"), strategy_options)
    base["task_options"] = key_values("--task-option", base.get("task_options"), task_options)
    return TrainConfig.from_dict(base, source=config_path or "command line")


def rank_values(flag: str, items) -> dict[int, float]:
    """``("3:2.0", ...)`` -> ``{3: 2.0, ...}``; ConfigError naming the flag otherwise."""
    out = {}
    for item in items:
        rank, sep, value = item.partition(":")
        if not sep or not rank.strip().isdigit():
            raise ConfigError(f"{flag} {item!r}: expected RANK:VALUE, e.g. 3:2.0")
        out[int(rank)] = _float(flag, value)
    return out


def _float(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected a number") from None
