"""The training flags `gossip peer`, `launch` and `simulate` share, and the TrainConfig they
make: one flag per scalar ``TrainConfig`` field and per ``DelayConfig`` field (the ``delays``
section), its help and default from the field's declaration (gossip/config.py,
gossip/faults.py), so nothing is restated here.

The flags are made when such a command first needs them (``TrainingCommand``): TrainConfig
imports torch, which takes seconds that `gossip --help` and the other commands do without.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping

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
    if default is dataclasses.MISSING or default is None or default == "":
        return ""
    if isinstance(default, bool):
        return str(default).lower()
    return f"{default:g}" if isinstance(default, float) else str(default)


#: The delay flags not named after their field (``--slowdown`` is ``slowdown``).
DELAY_FLAGS = {"compute": "compute-delay", "seed": "delay-seed"}


def delay_flags(delays=None) -> list[click.Option]:
    """A click option per field of ``delays`` (default: DelayConfig, the ``delays`` section),
    its help and default from the field's declaration (gossip/faults.py); a per-rank field
    takes ``RANK:VALUE``, repeatable (``[RANK:]VALUE`` where one number for all is allowed)."""
    if delays is None:
        from gossip.faults import DelayConfig as delays
    hints = typing.get_type_hints(delays)
    flags = []
    for spec in dataclasses.fields(delays):
        name = DELAY_FLAGS.get(spec.name, spec.name.replace("_", "-"))
        shown = "" if spec.default is dataclasses.MISSING else _shown(spec.default)
        default = f"  [default: {shown}]" if shown else ""
        kinds = _kinds(hints[spec.name])
        if any(typing.get_origin(kind) is Mapping for kind in kinds):  # per rank
            flags.append(click.Option(
                [f"--{name}", name.replace("-", "_")], multiple=True,
                metavar="[RANK:]VALUE" if float in kinds else "RANK:VALUE",
                help=f"{spec.metadata['doc']} Repeatable.{default}"))
        else:
            flags.append(click.Option([f"--{name}", name.replace("-", "_")], default=None,
                                      type=FLAG_TYPES[kinds[0]],
                                      help=spec.metadata["doc"] + default))
    return flags


def _kinds(hint) -> tuple:
    """The types a field of type ``hint`` takes (a union's members, None left out)."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return tuple(kind for kind in (typing.get_args(hint) if union else (hint,))
                 if kind is not type(None))


def delays_of(flags: dict, base: Mapping | None = None) -> dict:
    """The ``delays`` section: ``base`` (a config file's), with the delay flags given on top;
    the delay flags are taken out of ``flags``."""
    from gossip.faults import DelayConfig

    hints = typing.get_type_hints(DelayConfig)
    delays = dict(base or {})
    for spec, flag in zip(dataclasses.fields(DelayConfig), delay_flags(DelayConfig)):
        value = flags.pop(flag.name, None)
        if not flag.multiple:
            if value is not None:
                delays[spec.name] = value
        elif len(value or ()) == 1 and ":" not in value[0] and float in _kinds(hints[spec.name]):
            delays[spec.name] = _float(flag.opts[0], value[0])  # one number for every rank
        elif value:
            delays[spec.name] = rank_values(flag.opts[0], value)
    return delays


def other_flags() -> list[click.Option]:
    """The training flags that are neither a TrainConfig field nor a delay (strategy and task
    options, the shared device, the config file)."""
    from gossip.attacks import ATTACKS
    from gossip.crossover.connect import DeviceConfig  # declares the shared device's defaults

    return [
        click.Option(["--option", "strategy_options"], multiple=True, metavar="KEY=VALUE",
                     help="Strategy option, repeatable (e.g. piece_bytes=1048576)."),
        click.Option(["--attack"], multiple=True, metavar="RANK:KIND[,KEY=VALUE...]",
                     help=f"This rank attacks ({', '.join(ATTACKS.names())}), repeatable "
                          "with KEY=VALUE parameters (docs/ARCHITECTURE.md, Attacks)."),
        click.Option(["--arbiter"], metavar="ADDRESS",
                     help="Share each peer's device with other jobs through this arbiter: "
                          "ipc://PATH or tcp://HOST:PORT (`gossip arbiter`), flock:DIR, "
                          "slices:DIR."),
        click.Option(["--device"], metavar="NAME",
                     help="With --arbiter: the device, {rank} replaced by the rank "
                          f"(default {DeviceConfig.device})."),
        click.Option(["--job"], metavar="NAME",
                     help="With --arbiter: this job's name among those sharing the devices "
                          f"(turns go by name; default {DeviceConfig.job})."),
        click.Option(["--config", "config_path"], type=click.Path(dir_okay=False),
                     help="YAML with training settings (a run directory's config.yaml)."),
        click.Option(["--task-option", "task_options"], multiple=True, metavar="KEY=VALUE",
                     help="Task factory option, repeatable (e.g. width=1024, depth=8 of "
                          "deep-mlp; width=0.125 of resnet; size=full of gpt)."),
    ]


class TrainingCommand(click.Command):
    """A command that also takes the training flags (``@main.command(cls=TrainingCommand)``):
    the fields' flags, then the others, after the command's own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flags_made = False

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not self.flags_made:  # every use of the params (parsing, help) asks here first
            self.params.extend([*field_flags(), *delay_flags(), *other_flags()])
            self.flags_made = True
        return super().get_params(ctx)


def train_config(config_path, strategy_options, *, arbiter=None, device=None, job=None,
                 task_options=(), attack=(), **flags):
    """The TrainConfig of the training flags: ``--config``'s file (if any), each flag given
    on top. ``arbiter``, ``device`` and ``job`` are read by the caller (the shared device)."""
    from gossip.config import TrainConfig

    base = TrainConfig.from_yaml(config_path).to_dict() if config_path else {}
    base["delays"] = delays_of(flags, base.get("delays"))
    base.update({k: v for k, v in flags.items() if v is not None})
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
