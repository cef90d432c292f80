"""One exception family for everything gossip raises on purpose."""


class GossipError(Exception):
    """Base of every error gossip raises deliberately."""


class ConfigError(GossipError):
    """A configuration value, file or option is invalid; the message names it."""


class TopologyError(ConfigError):
    """A topology file or graph is invalid (duplicate rank, disconnected graph, bad port...)."""


class TransportError(GossipError):
    """A socket could not be opened, bound or used."""


class PeerTimeout(TransportError):
    """An expected message from a named peer did not arrive in time."""


class ProtocolError(GossipError):
    """A message broke the wire protocol (bad header, dtype, shape, size)."""
