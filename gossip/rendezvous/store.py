"""``Rendezvous``: where the peers meet (a launcher's key-value store) and the one exchange
they make there, "publish mine, read everyone's".

The store is torch.distributed's, opened as ``torch.distributed.rendezvous`` would open it
(but from the environment the Rendezvous was parsed with): the TCPStore torchrun's agent
already serves (``TORCHELASTIC_USE_AGENT_STORE``), or one rank 0 serves, or a FileStore on a
shared file system. It needs no process group. URIs:

* ``env://``: MASTER_ADDR and MASTER_PORT (torchrun, Kubeflow PyTorchJob).
* ``slurm://[HOST[:PORT]]``: the first node of the job step's node list, port derived from
  the job id, unless given; rank 0 (on that node) serves the store.
* ``tcp://HOST:PORT``: rank 0 serves the store there (or a standalone one runs there).
* ``file:///PATH``: a FileStore at PATH, on a file system every peer sees.

``?rank=R&world_size=N`` in the URI gives the rank and size where the launcher does not.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from datetime import timedelta
from urllib.parse import parse_qsl, urlsplit

from gossip import slurm
from gossip.errors import ConfigError, RendezvousError
from gossip.rendezvous import launchers
from gossip.rendezvous.contact import resolve, source_address

SCHEMES = ("env", "slurm", "tcp", "file")
USAGE = "env://, slurm://[HOST[:PORT]], tcp://HOST:PORT, file:///PATH or static"
# slurm:// without a port: this plus the job id modulo SLURM_PORT_SPAN (below the ephemeral
# range, so no peer's own port takes it first), each step of the job SLURM_STEP_STRIDE on:
# concurrent steps of one allocation start on one node and each serves a store of its own.
SLURM_BASE_PORT, SLURM_PORT_SPAN, SLURM_STEP_STRIDE = 20000, 10000, 1009
# Reaching a store that is not up yet: a try this often, and at least this long for c10d's
# own connect once one succeeded.
CONNECT_RETRY_S, CONNECT_MIN_S = 0.1, 1.0
CLOSE_WAIT_S = 10.0  # the longest a store's server waits at the end for the others to leave
JOINER = -1  # the rank a joiner opens the store as before it has an id: never its server


class Rendezvous:
    """Where the peers of a launcher-started job meet; build with ``parse``.

    Attributes:
        uri: As given.
        rank, size: From the URI's query, else None (the launcher's environment says).
        incarnation: Run id + restart count: the prefix of every key this job writes.
        timeout: Seconds to reach the store and to wait for every peer's key.
    """

    def __init__(self, uri: str, *, host: str | None, port: int | None, path: str | None,
                 rank: int | None, size: int | None, incarnation: launchers.Incarnation,
                 advertise: str | None, timeout: float, environ: Mapping[str, str]):
        self.uri, self.host, self.port, self.path = uri, host, port, path
        self.rank, self.size, self.incarnation = rank, size, incarnation
        self.advertise, self.timeout, self.environ = advertise, timeout, environ
        # Under torchrun its agent serves the store; else rank 0 does (tcp, env, slurm).
        self.agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        self._store = None
        self._serving = False

    @classmethod
    def parse(cls, uri: str, *, environ: Mapping[str, str] | None = None,
              advertise: str | None = None, timeout: float = 60.0) -> Rendezvous:
        """Raises ConfigError naming the URI and what is wrong with it (or the variable
        missing from the environment)."""
        environ = os.environ if environ is None else environ
        parts = urlsplit(uri)
        if parts.scheme not in SCHEMES or "://" not in uri:
            raise ConfigError(f"--rendezvous {uri!r}: unknown scheme (use {USAGE})")
        try:
            query = dict(parse_qsl(parts.query, strict_parsing=bool(parts.query)))
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ConfigError(f"--rendezvous {uri!r}: {exc}") from None
        for key in query:
            if key not in ("rank", "world_size"):
                raise ConfigError(f"--rendezvous {uri!r}: unknown parameter {key!r} "
                                  f"(rank, world_size)")
        rank = _query_int(uri, query, "rank", least=0)
        size = _query_int(uri, query, "world_size", least=1)
        path = None
        if parts.scheme == "env":
            host, port = _env_store(uri, environ)
        elif parts.scheme == "slurm":
            host = host or slurm.first_node(environ)
            port = port or _slurm_port(environ)
        elif parts.scheme == "tcp":
            if not host or not port:
                raise ConfigError(f"--rendezvous {uri!r}: tcp:// needs HOST:PORT")
        else:
            path = parts.path
            if host or not path or path == "/":
                raise ConfigError(f"--rendezvous {uri!r}: file:// needs an absolute path "
                                  f"(file:///shared/dir/store)")
        return cls(uri, host=host, port=port, path=path, rank=rank, size=size,
                   incarnation=launchers.Incarnation.from_env(environ), advertise=advertise,
                   timeout=timeout, environ=environ)

    def rank_of(self, flag: int | None = None) -> int:
        """This peer's rank: ``--rank``, else the URI's, else the launcher's variable."""
        if flag is not None:
            return flag
        return self.rank if self.rank is not None else launchers.require_rank(self.environ)

    def size_of(self) -> int:
        """How many peers meet: the URI's ``world_size``, else the launcher's variable."""
        return self.size if self.size is not None else launchers.require_size(self.environ)

    def size_origin(self) -> str:
        """Where ``size_of`` comes from, for messages: the URI or the launcher's variable."""
        if self.size is not None:
            return f"world_size={self.size} in the URI"
        return launchers.size_origin(self.environ)

    # -- where this peer listens --------------------------------------------------------

    def own_host(self) -> str:
        """The IP to bind and publish: ``advertise``, else the source address towards the
        store host (a FileStore has none: this host name's address)."""
        if self.advertise:
            return resolve(self.advertise)
        if self.host is None:
            return resolve(_hostname())
        return source_address(self.host, self.port)

    # -- the store ----------------------------------------------------------------------

    def store(self, rank: int, size: int):
        """The store, opened once (rank 0 serves it for tcp/env/slurm outside torchrun).

        Raises:
            ConfigError: a ``file://`` store's file cannot be opened (no such directory).
            RendezvousError: not reachable (or not servable) within ``timeout``.
        """
        if self._store is None:
            import torch.distributed as dist

            where = (f"file://{self.path}" if self.path
                     else f"tcp://{_host_port(self.host, self.port)}")
            self._serving = self.path is None and not self.agent_store and rank == 0
            timeout = timedelta(seconds=self.timeout)
            if self.path:
                # FileStore retries opening a missing file for its own 300 s before our
                # timeout applies: a file that opens here opens there at once.
                self._create_file()
            elif not self._serving:  # c10d's connect backoff overshoots the timeout
                timeout = timedelta(seconds=self._await_server(where))
            try:  # as torch.distributed.rendezvous would, with our environment's say
                if self.path:
                    # a joiner is no worker the file's clean-up counts
                    self._store = dist.FileStore(self.path, -1 if rank == JOINER else size)
                else:
                    self._store = dist.TCPStore(self.host, self.port, size, self._serving,
                                                timeout, wait_for_workers=False,
                                                multi_tenant=True)
                self._store.set_timeout(timedelta(seconds=self.timeout))
            except Exception as exc:  # noqa: BLE001 - c10d raises RuntimeError, DistError...
                raise RendezvousError(self._store_failure(where, exc)) from None
        return self._store

    def _create_file(self) -> None:
        """Raises ConfigError naming the path when the store's file cannot be opened."""
        try:
            with open(self.path, "ab"):
                pass
        except OSError as exc:
            raise ConfigError(f"--rendezvous {self.uri}: cannot open the store file "
                              f"{self.path}: {exc.strerror or exc} (a directory every peer "
                              f"sees must hold it)") from None

    def _await_server(self, where: str) -> float:
        """Wait until the store's server accepts connections; the seconds left of
        ``timeout``.

        Raises:
            RendezvousError: nothing accepted within ``timeout``.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            try:
                with socket.create_connection((self.host, self.port), timeout=max(left, 0.01)):
                    return max(deadline - time.monotonic(), CONNECT_MIN_S)
            except OSError as exc:
                failure = exc
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(self._store_failure(where, failure))
            time.sleep(min(CONNECT_RETRY_S, left))

    def _store_failure(self, where: str, exc: Exception) -> str:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        if self._serving:
            return (f"rendezvous {self.uri}: rank 0 could not serve the store at "
                    f"{where.removeprefix('tcp://')} or not every peer came within "
                    f"{self.timeout:g} s ({detail})")
        return (f"rendezvous {self.uri}: store {where} not reachable within {self.timeout:g} s "
                f"({detail})")

    def exchange(self, name: str, rank: int, size: int, value: bytes) -> list[bytes]:
        """Publish ``value`` as this rank's ``name`` and read every rank's, in one call;
        only this incarnation's keys are read.

        Raises:
            RendezvousError: naming the ranks whose key did not come within ``timeout``.
        """
        self.publish(name, rank, size, value)
        return self.read(name, range(size))

    def publish(self, name: str, rank: int, size: int, value: bytes) -> None:
        """Set this rank's ``name`` (under this incarnation's prefix) to ``value``."""
        store = self.store(rank, size)
        try:
            store.set(self._key(name, rank), value)
        except Exception as exc:  # noqa: BLE001 - the store itself is gone
            raise RendezvousError(f"rendezvous {self.uri}: lost the store while publishing "
                                  f"{name} ({exc})") from None

    def read(self, name: str, ranks) -> list[bytes]:
        """``name`` of each of ``ranks`` (this incarnation's), waiting for those not
        published yet; on an open store.

        Raises:
            RendezvousError: naming the ranks whose key did not come within ``timeout``.
        """
        store, ranks = self._store, list(ranks)
        keys = [self._key(name, r) for r in ranks]
        try:
            return store.multi_get(keys)
        except Exception as exc:  # noqa: BLE001 - timeouts and lost connections alike
            try:
                missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
            except Exception:  # noqa: BLE001 - the store itself is gone
                raise RendezvousError(f"rendezvous {self.uri}: lost the store while "
                                      f"exchanging {name} ({exc})") from None
            raise RendezvousError(f"rendezvous {self.uri}: rank(s) {_ranks(missing)} did not "
                                  f"publish their {name} within {self.timeout:g} s") from None

    def _key(self, name: str, rank: int | None = None) -> str:
        """A key of this incarnation: an older one's (a job restarted whole) is never read."""
        return f"{self.incarnation.prefix}{name}" + ("" if rank is None else f"/{rank}")

    # -- joins (elastic runs) -------------------------------------------------------------

    def announce_size(self, rank: int, size: int) -> None:
        """As a member of the job's start: say how many members started (a joiner reads it,
        ``members``)."""
        if rank == 0:
            self.store(rank, size).set(self._key("members"), str(size))

    def members(self) -> int:
        """How many members the job started with, as they announced it in the store (a
        joiner's own launcher, e.g. a torchrun of one process, says nothing of the job's).

        Raises:
            RendezvousError: nothing announced within ``timeout``.
        """
        store = self.store(JOINER, 1)
        try:
            return int(store.get(self._key("members")))
        except Exception as exc:  # noqa: BLE001 - a timeout, or the store is gone
            raise RendezvousError(f"rendezvous {self.uri}: no member of this job announced "
                                  f"its size within {self.timeout:g} s ({exc})") from None

    def next_id(self, members: int, spares: int) -> int:
        """A fresh member id for a peer joining the running job: after the ``members`` it
        started with, from a counter of this incarnation that only grows (the store's
        atomic add), so no id is ever given twice.

        Raises:
            RendezvousError: every one of the job's ``spares`` ids is taken.
        """
        taken = self.store(JOINER, members).add(self._key("joined"), 1)
        if taken > spares:
            raise RendezvousError(f"rendezvous {self.uri}: no join id left: the job's "
                                  f"{spares} spare id(s) (--spares) were all given")
        return members + taken - 1

    def entered(self, rank: int, size: int) -> None:
        """As a joiner that met the others: one more peer the store's server waits for at
        the end (``close``)."""
        self.store(rank, size).add(self._key("entered"), 1)

    def close(self, rank: int, size: int, *, wait: bool) -> None:
        """Leave the store. The rank serving it waits (bounded) for the others to leave
        first (the ``size`` the job started with, and the joiners that met them), so none
        loses it while still reading."""
        if self._store is None:
            return
        store, self._store = self._store, None
        key = self._key("left")
        try:
            left = store.add(key, 1)
            deadline = time.monotonic() + min(self.timeout, CLOSE_WAIT_S)
            while wait and self._serving and time.monotonic() < deadline \
                    and left < size + store.add(self._key("entered"), 0):
                time.sleep(0.05)
                left = store.add(key, 0)
        except Exception:  # noqa: BLE001 - the store went first: nothing to wait for
            pass


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) or "(none)"


def _hostname() -> str:
    return socket.gethostname()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _query_int(uri: str, query: dict, key: str, *, least: int) -> int | None:
    if key not in query:
        return None
    try:
        value = int(query[key])
    except ValueError:
        value = None
    if value is None or value < least:
        raise ConfigError(f"--rendezvous {uri!r}: {key}={query[key]!r} is not an integer "
                          f">= {least}")
    return value


def _env_store(uri: str, environ: Mapping[str, str]) -> tuple[str, int]:
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name, "").strip()]
    if missing:
        raise ConfigError(f"--rendezvous {uri}: ${' and $'.join(missing)} not set (torchrun "
                          f"and Kubeflow set them; else use tcp://HOST:PORT)")
    port = environ["MASTER_PORT"].strip()
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--rendezvous {uri}: $MASTER_PORT={port!r} is not a port")
    return environ["MASTER_ADDR"].strip(), int(port)


def _slurm_port(environ: Mapping[str, str]) -> int:
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job.isdigit():
        raise ConfigError(f"--rendezvous slurm://: $SLURM_JOB_ID={job!r} is not a job id (run "
                          f"under srun, or give slurm://HOST:PORT)")
    step = launchers.slurm_step(environ) or 0
    return SLURM_BASE_PORT + (int(job) + SLURM_STEP_STRIDE * step) % SLURM_PORT_SPAN
