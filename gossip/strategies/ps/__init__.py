"""The parameter server ``ps``: sync, async and stale-synchronous (ssp) modes over sharded
servers whose roles the topology gives."""

from gossip.strategies.base import STRATEGIES
from gossip.strategies.ps.options import PSOptions
from gossip.strategies.ps.strategy import ParameterServer

__all__ = ["AsyncParameterServer", "PSOptions", "ParameterServer", "SyncParameterServer"]


class SyncParameterServer(ParameterServer):
    """Sync mode: the servers average the pushed gradients; every worker steps alike."""

    operates_on = "grads"
    exact_mean = True  # unless backup, participation or robust: see capabilities_for
    preserves_mean = True

    @classmethod
    def capabilities_for(cls, options: PSOptions):
        every = options.backup == 0 and options.participation == 1.0
        return options.gathered_capabilities({**super().capabilities_for(options),
                                              "exact_mean": every, "preserves_mean": every})

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        held = self.capabilities_for(self.options)
        self.exact_mean, self.preserves_mean, self.checks_own_result = (
            held["exact_mean"], held["preserves_mean"], held["checks_own_result"])


class AsyncParameterServer(ParameterServer):
    """Async / ssp: workers step locally, push parameter deltas and pull the model."""

    operates_on = "params"
    synchronous = False  # no global round: each worker pulls whenever the server answers


@STRATEGIES.register("ps", options=PSOptions)
def parameter_server(options: PSOptions) -> type:
    """Parameter servers (sharded; sync, async or ssp), roles from the topology."""
    return SyncParameterServer if options.mode == "sync" else AsyncParameterServer
