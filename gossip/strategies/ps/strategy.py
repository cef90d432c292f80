"""The parameter-server strategy: workers push to S sharded servers and pull the result.

Shard k of the flat vector (``bounds``) lives on ``servers[k]``. A rank that serves runs
its shard's ``ShardServer`` whenever it waits (inside ``synchronize``, between
mini-batches through ``stop_requested``, and in ``serve`` after its own rounds), so a rank
may be worker and server at once on the one transport thread. Everything is one message
kind; ``meta["op"]`` says push, init, delta, pull, refuse or done.

* sync (``operates_on = "grads"``): every worker pushes its gradient's shards, each server
  sums them in rank order and replies the mean to every worker: the same bits everywhere.
* async / ssp (``"params"``): the first call pushes the parameters and pulls their mean
  (a common start); later calls push the delta since the last pull, scaled by ``scale``
  (default 1/W) on the server, and pull the server's current parameters.

A dead worker: sync stops with PeerGone naming it (unless ``backup`` covers it); async and
ssp drop it. A worker that said goodbye while the others still synchronize (it ran fewer
rounds): each server refuses the steps it leaves unable to close, and the workers waiting
for them stop with PeerGone naming it. A dead server: every worker stops with PeerGone
naming it (its shard is lost).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gossip.errors import ConfigError, PeerGone, PeerTimeout, ProtocolError
from gossip.strategies.base import Strategy, base_tag
from gossip.strategies.ps.options import PSOptions
from gossip.strategies.ps.server import INIT_STEP, ShardServer
from gossip.strategies.ps.shards import bounds, check_backup, participants, roles_of
from gossip.transport import Message
from gossip.transport.windowed import Silence

log = logging.getLogger("gossip.ps")
POLL_S = 0.2  # how often a wait looks at the peers known lost
OPS = ("push", "init", "delta", "pull", "refuse", "done")


class ParameterServer(Strategy):
    """Workers push to sharded parameter servers and pull the result (sync, async, ssp);
    roles come from the topology (without any: every peer trains and serves one shard)."""

    options_class = PSOptions
    serves_roles = True

    def __init__(self, *, rank, topology, transport, options: PSOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        roles = roles_of(topology)
        self.servers, self.workers = roles.servers, roles.workers
        check_backup(self.options.backup, self.workers)
        self.trains = rank in self.workers
        # Under overlap every gradient bucket has its own instance (tag TAG.bI); a
        # server-only rank attached no model, so its one instance serves every bucket: a
        # shard server per bucket tag, made at the bucket's first message.
        self.base_tag = base_tag(self.options.tag)
        self.shards: dict[str, ShardServer] = {}
        self.server = self._shard(self.options.tag) if rank in self.servers else None
        self.pulls: dict[tuple[int, int], Message] = {}  # (step, shard) -> an answer
        self.refusals: dict[int, Message] = {}  # step -> a server's refusal of it
        self.clock = 0  # async/ssp: deltas pushed
        self.last: torch.Tensor | None = None  # async/ssp: the parameters last pulled
        self.pulled_clocks: list[tuple[int, int]] = []  # (own clock, slowest) per pull
        self.round_seen = 0
        self.synchronized = False  # this worker pushed or pulled at least once
        self.served = False
        partners = set(self.servers if self.trains else ()) | set(
            self.workers if self.server is not None else ())
        transport.connect(sorted(partners - {rank}))  # so a death is noticed at once

    # -- a worker's round --------------------------------------------------------------------
    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        if not self.trains:
            raise ConfigError(f"rank {self.rank} is a server only (topology roles): it "
                              f"serves (Peer.serve) and does not train")
        flat, dest = x.reshape(-1), self._output(x, out)
        self.round_seen = max(self.round_seen, round)
        self.synchronized = True
        parts = bounds(flat.numel(), len(self.servers))
        if self.options.mode == "sync":
            push, step, payload = "push", round, flat
            o = self.options
            if self.rank not in participants(self.workers, o.participation, o.seed, round):
                push = None
        elif self.last is None:
            push, step, payload = "init", INIT_STEP, flat
        else:
            if self.last.numel() != flat.numel():
                raise ProtocolError(f"rank {self.rank}: ps got {flat.numel()} elements, "
                                    f"{self.last.numel()} before (the length must not change)")
            self.clock += 1
            push, step, payload = "delta", self.clock, flat - self.last
        sent = []
        if push is not None:
            for k, (lo, hi) in enumerate(parts):
                sent.append(self._send(self.servers[k], push, step, payload[lo:hi],
                                       n=flat.numel(), clock=self.clock))
        wanted = [(step, k) for k in range(len(self.servers))]
        self._pump(lambda: step in self.refusals or all(key in self.pulls for key in wanted),
                   lambda: f"answer from server(s) {self._silent(wanted)} for round {round}",
                   lambda: self._awaited(wanted))
        if step in self.refusals:
            raise self._refused(self.refusals[step], round)
        answers = [self.pulls.pop(key) for key in wanted]
        for delivery in sent:  # our pushes were read zero-copy: wait before x may change
            if delivery is not None:
                delivery.wait()
        for answer, (lo, hi) in zip(answers, parts):
            dest[lo:hi].copy_(self._expect(answer, hi - lo))
        if self.options.mode != "sync":
            self.last = dest.clone()
            self.pulled_clocks.append(
                (self.clock, min(int(m.meta.get("min_clock", 0)) for m in answers)))
        return dest.view_as(x)

    def stop_requested(self, round: int) -> bool:
        """Between mini-batches: serve what waits (never blocks)."""
        if self.server is not None:
            while True:
                try:
                    self._handle(self.transport.recv(kind=self.options.tag, timeout=0))
                except PeerTimeout:
                    break
        return False

    def serve(self) -> None:
        """Say goodbye to every server, then (a server) answer until every worker did."""
        if self.served:
            return
        self.served = True
        if self.trains:
            # A server that trains too waits only for workers it heard from (below).
            for server in self.servers:
                if self.synchronized or server not in self.workers:
                    self._send(server, "done", self.round_seen, None)
        if self.server is not None:
            # A server only waits for every worker; one that trains too has met every worker
            # in its first round (sync steps and the async start need them all), so it waits
            # for those it heard from: none, if it never synchronized.
            self._pump(lambda: self._waiting_for() <= self.server.done,
                       lambda: f"goodbye from worker(s) {self._unfinished()}",
                       lambda: self._waiting_for() - self.server.done)

    # -- messages ------------------------------------------------------------------------------
    def _send(self, dst: int, op: str, round: int, tensor: torch.Tensor | None, *,
              kind: str | None = None, **meta):
        """Send ``op`` to ``dst`` (as ``kind``, default our tag); to ourselves it is handled
        at once (a copy). A bucket's instance reaches a server-only rank under the tag that
        rank has, naming its bucket."""
        buffers = () if tensor is None else (tensor,)
        kind = kind or self.options.tag
        if kind != self.base_tag and dst not in self.workers:
            kind, meta = self.base_tag, {**meta, "bucket": kind}
        msg = Message(kind=kind, round=round, meta={"op": op, **meta}, buffers=buffers)
        if dst == self.rank:
            own = tuple(b.clone() for b in buffers)
            self._handle(Message(kind=msg.kind, round=round, src=self.rank, meta=msg.meta,
                                 buffers=own))
            return None
        return self.transport.send(dst, msg, track=tensor is not None)

    def _shard(self, tag: str) -> ShardServer:
        """The shard server of the instance tagged ``tag`` (made now if new)."""
        if tag not in self.shards:
            self.shards[tag] = ShardServer(self.workers, self.options,
                                           functools.partial(self._reply, tag),
                                           functools.partial(self._refuse, tag))
        return self.shards[tag]

    def _reply(self, tag: str, worker: int, meta: dict, tensor: torch.Tensor) -> None:
        shard = self.servers.index(self.rank)
        self._send(worker, "pull", meta["step"], tensor, kind=tag, shard=shard, **meta)

    def _bucket_shard(self, msg: Message) -> ShardServer | None:
        """The shard server a worker's message is for: ours, or on a server-only rank the
        one of the bucket it names (None: a bucket this rank cannot serve, rejected)."""
        bucket = msg.meta.get("bucket")
        if bucket is None:
            return self.server
        if (self.trains or not isinstance(bucket, str) or bucket == self.options.tag
                or base_tag(bucket) != self.options.tag):
            self.transport.reject(f"{msg.kind} from peer {msg.src}: bucket {bucket!r} is not "
                                  f"one of {self.options.tag!r} served here")
            return None
        return self._shard(bucket)

    def _refuse(self, tag: str, worker: int, step: int, stopped: int,
                last: int | None) -> None:
        self._send(worker, "refuse", step, None, kind=tag, worker=stopped,
                   **({} if last is None else {"last": last}))

    def _refused(self, msg: Message, round: int) -> PeerGone:
        stopped, last = msg.meta["worker"], msg.meta.get("last")
        how = ("is dead (" if last is None else f"stopped after round {last} (it said "
               f"goodbye; sync: every worker must synchronize the same rounds; ")
        return PeerGone(f"rank {self.rank}: round {round} can never complete: worker "
                        f"{stopped} {how}option backup lets a step go on without it); "
                        f"parameter server {msg.src} refused it", rank=stopped)

    def _handle(self, msg: Message) -> None:
        op = msg.meta.get("op")
        if op not in OPS:
            self.transport.reject(f"{msg.kind} from peer {msg.src}: unknown op {op!r}")
            return
        if op == "pull":
            if msg.src not in self.servers or not self.trains:
                self.transport.reject(f"{msg.kind} pull from peer {msg.src}, not a server")
                return
            # Keyed by step: a late worker (backup) may hold answers of two steps at once.
            self.pulls[(msg.round, self.servers.index(msg.src))] = msg
            return
        if op == "refuse":
            stopped, last = msg.meta.get("worker"), msg.meta.get("last", 0)
            if msg.src not in self.servers or not self.trains or stopped not in self.workers \
                    or not isinstance(last, int):
                self.transport.reject(f"{msg.kind} refuse from peer {msg.src}: not a server, "
                                      f"or no worker named")
                return
            self.refusals.setdefault(msg.round, msg)
            return
        if self.server is None or msg.src not in self.workers:
            self.transport.reject(f"{msg.kind} {op} from peer {msg.src}: not a worker of a "
                                  f"shard served here")
            return
        if op == "done":
            for shard in self.shards.values():
                shard.goodbye(msg.src, msg.round)
            return
        server = self._bucket_shard(msg)
        if server is None:
            return
        n = msg.meta.get("n")
        if not isinstance(n, int) or n < 0:
            self.transport.reject(f"{msg.kind} {op} from peer {msg.src} without a length n")
            return
        lo, hi = bounds(n, len(self.servers))[self.servers.index(self.rank)]
        tensor = self._expect(msg, hi - lo)
        if server.model is not None and op == "delta" and tensor.numel() != \
                server.model.numel():
            raise ProtocolError(f"rank {self.rank}: peer {msg.src} pushed {n} elements in all "
                                f"(do all peers synchronize tensors of the same length?)")
        if op == "delta":
            if server.model is None:
                self.transport.reject(f"{msg.kind} delta from peer {msg.src} before its init")
                return
            server.delta(msg.src, int(msg.meta.get("clock", 0)), tensor)
        else:
            self._check_length(server, msg.src, msg.round, n)
            server.push(msg.src, msg.round, tensor)

    def _check_length(self, server: ShardServer, src: int, step: int, n: int) -> None:
        """Pushes of one step must agree on the vector's length."""
        for other in server.steps.get(step, {}).values():
            lo, hi = bounds(n, len(self.servers))[self.servers.index(self.rank)]
            if other.numel() != hi - lo:
                raise ProtocolError(f"rank {self.rank}: peer {src} pushed {n} elements in "
                                    f"step {step}, others a different length (do all peers "
                                    f"synchronize tensors of the same length?)")

    # -- waiting -------------------------------------------------------------------------------
    def _pump(self, done: Callable[[], bool], waiting: Callable[[], str],
              waiting_on: Callable[[], set[int]]) -> None:
        """Handle messages until ``done()``; PeerGone for a dead server (or a dead worker a
        sync step needs). Waits as long as one of ``waiting_on()`` is alive (workers in a long
        local period are); PeerTimeout after ``timeout`` of silence (``Silence``)."""
        silence = Silence(self.transport)
        tag = self.options.tag
        while not done():
            try:  # what arrived comes first: a server's last words may say who stopped
                msg = self.transport.recv(kind=tag, timeout=0)
            except PeerTimeout:
                self._check_lost()
                if silence.over(waiting_on()):
                    raise PeerTimeout(f"rank {self.rank}: no {waiting()}, and no sign of "
                                      f"life, within {self.transport.timeout:g} s") from None
                try:
                    msg = self.transport.recv(kind=tag, timeout=min(POLL_S, silence.left()))
                except PeerTimeout:
                    continue
            silence.heard()
            self._handle(msg)

    def _check_lost(self) -> None:
        lost = self.transport.membership.lost
        if not lost:
            return
        for server in self.servers:  # a worker that said goodbye needs them no more
            if server in lost and self.trains and not self.served and server != self.rank:
                raise PeerGone(f"rank {self.rank}: parameter server {server} "
                               f"({self.transport.describe(server)}) is dead "
                               f"({lost[server].reason}): shard "
                               f"{self.servers.index(server)} of the model is lost", rank=server)
        if self.server is None:
            return
        dead = {w for w in self.workers if w in lost and w not in self.server.done}
        if not dead:
            return
        if self.options.mode == "sync":
            why = next(filter(None, (s.waiting_on(set(lost)) for s in self.shards.values())),
                       None)
            if why is not None:
                first = min(dead)
                for shard in self.shards.values():  # the workers waiting name it too
                    shard.refuse_stuck(set(lost))
                raise PeerGone(f"rank {self.rank}: parameter server cannot finish: {why} "
                               f"({lost[first].reason}; option backup lets a step go on "
                               f"without late workers)", rank=first)
        for worker in sorted(dead):  # it pushes nothing more and holds back no pull
            log.warning("rank %d: parameter server drops dead worker %d", self.rank, worker)
            for shard in self.shards.values():
                shard.goodbye(worker)

    def _silent(self, wanted) -> str:
        return ", ".join(str(self.servers[k]) for step, k in wanted
                         if (step, k) not in self.pulls)

    def _awaited(self, wanted) -> set[int]:
        """Whom a worker's wait for its answers depends on: the servers yet to answer, and,
        if one is this rank, the workers whose pushes its own shard may still need."""
        servers = {self.servers[k] for step, k in wanted if (step, k) not in self.pulls}
        return servers | set(self.workers) if self.rank in servers else servers

    def _waiting_for(self) -> set[int]:
        return set(self.workers) if not self.trains else self.server.heard

    def _unfinished(self) -> str:
        return ", ".join(str(w) for w in sorted(self._waiting_for() - self.server.done))

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"clock": self.clock, "last": self.last}
        if self.options.robust is not None:  # each shard's last robust aggregate
            state["aggregates"] = {tag: shard.last_aggregate
                                   for tag, shard in self.shards.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clock = int(state.get("clock", 0))
        self.last = state.get("last")
        for tag, aggregate in state.get("aggregates", {}).items():
            self._shard(tag).last_aggregate = aggregate
