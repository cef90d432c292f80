"""Local SGD: H local steps sending nothing, then an inner strategy averages the parameters.

* ``period`` H: rounds ``warmup + k`` with ``k % H == H - 1`` average through the inner
  strategy (ring-allreduce: exactly; dpsgd or matcha: one gossip step, i.e. decentralized
  local SGD; ps: through parameter servers). H = 1 with plain SGD is mini-batch SGD.
* ``warmup_rounds`` (post-local SGD, Lin et al. 2020): the first rounds average gradients
  exactly (the inner strategy when it is an exact mean, else a ring all-reduce of our own),
  then local SGD. One setting: the rounds count from 0 and the period from the warm-up's end.
* ``group_period`` (hierarchical): a shorter period whose rounds average exactly inside each
  group (``groups``, by default the peers of each host); the global period is a multiple.
* ``optimizer_state`` at an average: ``keep`` the momentum local, ``reset`` it, or
  ``average`` it with the model (``Peer.step`` adds the momentum buffers to the vector).
* ``outer_lr``, ``outer_momentum``, ``nesterov`` (DiLoCo): an outer SGD steps the agreed
  model G on the exact mean of the pseudo-gradients; ``fragments`` K (streaming DiLoCo):
  one of K slices is averaged every H/K steps, in turn (``outer.py``).

See ``shared/specs/sync-modes.md`` section 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gossip.strategies.base import EXACT_MEAN, STRATEGIES, RoundPlan, Strategy
from gossip.strategies.local.groups import GroupMean, resolve_groups
from gossip.strategies.local.options import LocalOptions
from gossip.strategies.local.outer import OuterSGD


@STRATEGIES.register("local")
class Local(Strategy):
    """Local SGD: H local steps, then the inner strategy averages the parameters (optionally
    a gradient warm-up before, group averages in between, DiLoCo's outer step on the
    average, streamed in fragments); nothing is sent in between."""

    options_class = LocalOptions
    operates_on = "params"
    plans_rounds = True
    wraps = True

    def __init__(self, *, rank, topology, transport, options: LocalOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        opts = self.options
        self.inner = STRATEGIES.create(opts.inner, rank=rank, topology=topology,
                                       transport=transport, options=opts.inner_options)
        for key, value in self.capabilities_for(opts).items():
            setattr(self, key, value)
        self.warm = self.inner
        if opts.warmup_rounds and not self.inner.exact_mean:
            self.warm = STRATEGIES.create(EXACT_MEAN, rank=rank, topology=topology,
                                          transport=transport,
                                          options={"tag": f"{opts.tag}.warm"})
        self.group: GroupMean | None = None
        if opts.group_period is not None:
            mine = next(g for g in resolve_groups(opts.groups, topology) if rank in g)
            self.group = GroupMean(rank, mine, transport, f"{opts.tag}.group")
        self.outer: OuterSGD | None = None
        if opts.outer or opts.fragments > 1:
            self.outer = OuterSGD(lr=opts.outer_lr, momentum=opts.outer_momentum,
                                  nesterov=opts.nesterov, fragments=opts.fragments)

    @classmethod
    def capabilities_for(cls, options: LocalOptions) -> dict[str, Any]:
        inner_cls = STRATEGIES.strategy_class(options.inner, options.inner_options)
        inner = inner_cls.capabilities_for(options.inner_options)
        every_round = options.period == 1 and options.group_period is None
        plain = not options.outer  # the outer step moves the average; a fragment's mean not
        return {**inner, "operates_on": "params",
                "exact_mean": bool(inner["exact_mean"] and every_round and plain),
                # an exact mean, a group mean and sending nothing all keep the average
                "preserves_mean": bool(plain and (inner["preserves_mean"]
                                                  or inner["exact_mean"])),
                "can_rejoin": False, "checks_own_result": False, "plans_rounds": True,
                "wraps": True, "survives_death": False, "mixes_on_views": False,
                # group means and a warm-up all-reduce of our own need every rank to train
                "serves_roles": bool(inner["serves_roles"] and options.group_period is None
                                     and (not options.warmup_rounds or inner["exact_mean"]))}

    @property
    def kinds(self) -> tuple[str, ...]:
        own = tuple(dict.fromkeys((*self.inner.kinds, *self.warm.kinds)))
        return own + ((self.group.kind,) if self.group is not None else ())

    def phase(self, round: int) -> str | None:
        """``"warmup"``, ``"global"`` (inner average, of one fragment with several),
        ``"group"``, or None (local step)."""
        opts = self.options
        if round < opts.warmup_rounds:
            return "warmup"
        k = round - opts.warmup_rounds + 1
        if k % (opts.period // opts.fragments) == 0:
            return "global"
        if opts.group_period is not None and k % opts.group_period == 0:
            return "group"
        return None

    def fragment(self, round: int) -> int:
        """The slice a global ``round`` averages: the averages since the warm-up, mod K."""
        opts = self.options
        averages = (round - opts.warmup_rounds + 1) // (opts.period // opts.fragments)
        return (averages - 1) % opts.fragments

    def round_plan(self, round: int) -> RoundPlan:
        phase = self.phase(round)
        if phase == "warmup":
            return RoundPlan("grads")
        return RoundPlan("params", exchange=phase is not None,
                         optimizer_state=self.options.optimizer_state)

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The round's average of ``x`` (warm-up: the exact mean; with an outer optimizer:
        G after its step), or ``x`` itself in a local round."""
        return self.synchronize_model(x, round, parameters=x.numel(), out=out)

    def synchronize_model(self, x: torch.Tensor, round: int, *, parameters: int,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """``synchronize``; the outer step moves only the first ``parameters`` elements,
        the float buffers after them are averaged."""
        phase = self.phase(round)
        if phase == "global" and self.outer is not None:
            flat, dest = x.reshape(-1), self._output(x, out)
            self.outer.average(flat, self.fragment(round), parameters,
                               lambda v: self.inner.synchronize(v, round, out=v), dest)
            return dest.view_as(x)
        if phase == "global":
            return self.inner.synchronize(x, round, out=out)
        if phase == "warmup":
            return self.warm.synchronize(x, round, out=out)
        flat, dest = x.reshape(-1), self._output(x, out)
        if phase == "group":
            return self.group.average(flat, round, dest, self._expect).view_as(x)
        if dest.data_ptr() != flat.data_ptr():
            dest.copy_(flat)
        return dest.view_as(x)

    def average_gradients(self, total: torch.Tensor, count: int, round: int, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """Warm-up rounds: the exact mean gradient."""
        return self.warm.average_gradients(total, count, round, out=out)

    def serve(self) -> None:
        self.inner.serve()

    def poll(self) -> None:
        self.inner.poll()

    def finish(self) -> None:
        self.inner.finish()

    def state_dict(self) -> dict[str, Any]:
        """The inner strategy's, and the outer optimizer's (G, its momentum)."""
        state = {"inner": self.inner.state_dict()}
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        if self.outer is not None:
            self.outer.load_state_dict(state.get("outer", {}))
