"""SLURM node lists: ``node[572-578]``, ``a[01-03,07],b5``, ``r[1-2]n[3-4]`` expanded to host names.

python-hostlist (the parser of NSC's hostlist tools, kept since 2008) expands every form
srun writes, zero padding and several bracket groups in one name included, in SLURM's own
order; this module only turns its errors into ours.
"""

from __future__ import annotations

import hostlist

from gossip.errors import ConfigError

#: Where srun and sbatch put the node list, most specific first.
NODELIST_ENV = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def expand(nodelist: str, *, source: str = "node list") -> list[str]:
    """The host names of a compressed SLURM node list, in order.

    Raises:
        ConfigError: ``"<source> '<text>': <why>"`` for an empty or malformed list.
    """
    if not isinstance(nodelist, str) or not nodelist.strip():
        raise ConfigError(f"{source} {nodelist!r}: empty (expected e.g. node[01-04])")
    try:
        hosts = hostlist.expand_hostlist(nodelist.strip())
    except hostlist.BadHostlist as exc:
        raise ConfigError(f"{source} {nodelist!r}: not a SLURM node list ({exc})") from None
    if not hosts or any(not host for host in hosts):
        raise ConfigError(f"{source} {nodelist!r}: not a SLURM node list (an empty name)")
    return hosts


def first_node(environ) -> str:
    """The first host of this job step's node list (where SLURM starts task 0).

    Raises:
        ConfigError: naming every variable read when none is set, or the malformed one.
    """
    for name in NODELIST_ENV:
        value = environ.get(name, "")
        if value.strip():
            return expand(value, source=f"${name}")[0]
    raise ConfigError(f"no SLURM node list: none of ${', $'.join(NODELIST_ENV)} is set "
                      f"(run under srun, or give slurm://HOST:PORT)")
