"""One exception family for everything gossip raises on purpose."""


class GossipError(Exception):
    """Base of every error gossip raises deliberately."""


class ConfigError(GossipError):
    """A configuration value, file or option is invalid; the message names it."""


class TopologyError(ConfigError):
    """A topology file or graph is invalid (duplicate rank, disconnected graph, bad port...)."""


class CheckpointError(ConfigError):
    """A checkpoint file is missing, corrupt or belongs to another run; the message names it."""


class PeerNotOpen(GossipError):
    """A ``Peer`` was used outside its ``with`` block: before it opened or after it closed."""


class TransportError(GossipError):
    """A socket could not be opened, bound or used."""


class PeerTimeout(TransportError):
    """An expected message from a named peer did not arrive in time."""


class PeerGone(PeerTimeout):
    """An expected message will never arrive: the peer is dead (see docs/ARCHITECTURE.md,
    Dead peers). The message names its rank, address and the round; ``rank`` is the dead
    peer's."""

    def __init__(self, message: str, *, rank: int):
        super().__init__(message)
        self.rank = rank


class CollectiveAborted(TransportError):
    """A round of an all-peer exchange (e.g. the consensus probe) was abandoned by every peer
    because a restarted peer rejoined while it was under way."""


class RejoinError(TransportError):
    """A peer restarted from a checkpoint could not rejoin the running peers."""


class RendezvousError(GossipError):
    """Peers could not meet through a launcher's store (unreachable, too slow, a peer missing);
    the message names the store and the peers missing."""


class ProtocolError(GossipError):
    """A message broke the wire protocol (bad header, dtype, shape, size)."""


class TransportBusy(GossipError):
    """The transport was used while the communication thread of ``Peer.attach`` had it: it
    is single-threaded, so nothing else may touch it until ``Peer.step`` has waited."""


class LaunchFailed(GossipError):
    """A launched run failed: a peer failed before training started (the others were
    stopped), no peer finished, or peers died that the run did not tolerate. ``rank``,
    ``code`` and ``reason`` are the first failed peer's."""

    def __init__(self, rank: int, code: int, reason: str, *, message: str | None = None):
        super().__init__(message or f"peer {rank} failed (exit code {code}): {reason}")
        self.rank, self.code, self.reason = rank, code, reason


class BenchmarkFailed(GossipError, RuntimeError):
    """A benchmark run failed: a rank raised (the message names it; later lines carry its
    traceback), exited without a result, or did not finish in time, or a baseline's result
    was wrong. Also a ``RuntimeError``, as the harness raised before it had its own."""


class NetnsError(GossipError):
    """A namespace, link or qdisc command of a virtual cluster failed; the message names the
    command."""


class NetnsUnavailable(NetnsError):
    """This machine cannot host a virtual cluster: it needs root, iproute2 and netns."""
