"""What a launcher tells its processes through the environment: rank, size, and which
incarnation of the job this is (run id + restart count).

torchrun and Kubeflow set RANK/WORLD_SIZE, srun SLURM_PROCID/SLURM_NTASKS, Open MPI
OMPI_COMM_WORLD_RANK/SIZE, MPICH and Intel MPI PMI_RANK/PMI_SIZE; the first one set wins,
and an error names every variable read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gossip.errors import ConfigError

RANK_ENV = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
SIZE_ENV = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# Who names the job, innermost launcher first (every rank of a job must pick the same one):
# torchrun (its run id, whatever launched torchrun); an MPI job, a new one per mpirun (PMIx's
# namespace, or Open MPI's own job id): its ranks also see the allocation's SLURM_JOB_ID, and
# those on mpirun's node no step id; then SLURM's job, with the step (below) telling apart
# the concurrent steps of one allocation. MPICH's Hydra (PMI-1) sets no job id.
RUN_ID_ENV = ("TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID")
SLURM_STEP_ENV = ("SLURM_STEP_ID", "SLURM_STEPID")
# torchrun counts its restarts (every worker restarts together); a requeued SLURM job keeps
# its id and counts requeues.
RESTART_ENV = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def _first(environ: Mapping[str, str], names) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def _integer(name: str, value: str, *, least: int, what: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < least:
        raise ConfigError(f"${name}={value!r} is not {what}")
    return number


def rank_from(environ: Mapping[str, str]) -> int | None:
    """This process's rank as its launcher set it; None if no launcher did."""
    found = _first(environ, RANK_ENV)
    return None if found is None else _integer(*found, least=0, what="a rank")


def size_from(environ: Mapping[str, str]) -> int | None:
    """How many processes the launcher started; None if no launcher said."""
    found = _first(environ, SIZE_ENV)
    return None if found is None else _integer(*found, least=1, what="a number of peers")


def size_origin(environ: Mapping[str, str]) -> str:
    """The variable ``size_from`` read, as ``$NAME=VALUE`` (for messages)."""
    found = _first(environ, SIZE_ENV)
    return "no launcher variable" if found is None else f"${found[0]}={found[1]}"


def slurm_step(environ: Mapping[str, str]) -> int | None:
    """The SLURM job step this process belongs to (srun sets it); None outside one."""
    found = _first(environ, SLURM_STEP_ENV)
    return None if found is None else _integer(*found, least=0, what="a SLURM step id")


def require_rank(environ: Mapping[str, str]) -> int:
    rank = rank_from(environ)
    if rank is None:
        raise ConfigError(f"no rank: pass --rank or set one of ${', $'.join(RANK_ENV)}")
    return rank


def require_size(environ: Mapping[str, str]) -> int:
    size = size_from(environ)
    if size is None:
        raise ConfigError(f"no number of peers: give world_size= in the rendezvous URI or set "
                          f"one of ${', $'.join(SIZE_ENV)}")
    return size


@dataclass(frozen=True)
class Incarnation:
    """One start of a job: every key it writes to the store carries ``prefix``, so a
    restarted job never reads what a dead incarnation left there."""

    run_id: str
    restart: int

    @property
    def prefix(self) -> str:
        return f"gossip/{self.run_id}/{self.restart}/"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Incarnation:
        run = _first(environ, RUN_ID_ENV)
        restart = _first(environ, RESTART_ENV)
        count = 0 if restart is None else _integer(*restart, least=0, what="a restart count")
        if run is None:
            return cls("job", count)
        name, run_id = run
        step = slurm_step(environ) if name == "SLURM_JOB_ID" else None
        return cls(run_id if step is None else f"{run_id}.{step}", count)
