"""Rendezvous URIs, launcher environments, the store exchange (torch's real TCPStore and
FileStore, in this process), checkpoint generations and the restarted job's agreement."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gossip import checkpoint
from gossip.errors import CheckpointError, ConfigError, RendezvousError
from gossip.ports import free_ports
from gossip.rendezvous import Incarnation, Rendezvous
from gossip.rendezvous.contact import Contact, this_machine
from gossip.rendezvous.launchers import rank_from, require_rank, require_size, size_from
from gossip.rendezvous.restart import common_round


@pytest.mark.parametrize("env, rank, size", [
    ({"RANK": "3", "WORLD_SIZE": "5"}, 3, 5),  # torchrun, Kubeflow
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "7"}, 2, 7),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3"}, 0, 3),
    ({"PMI_RANK": "4", "PMI_SIZE": "6"}, 4, 6),  # MPICH, Intel MPI
    ({"RANK": "1", "SLURM_PROCID": "9", "WORLD_SIZE": "2", "SLURM_NTASKS": "16"}, 1, 2),
])
def test_rank_and_size_come_from_whichever_launcher_started_us(env, rank, size):
    assert (rank_from(env), size_from(env)) == (rank, size)


def test_missing_or_bad_launcher_variables_name_every_variable_read():
    with pytest.raises(ConfigError) as info:
        require_rank({})
    assert all(f"${name}" in str(info.value)
               for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))
    with pytest.raises(ConfigError) as info:
        require_size({})
    assert all(f"${name}" in str(info.value)
               for name in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
    with pytest.raises(ConfigError, match=r"\$PMI_RANK='x' is not a rank"):
        require_rank({"PMI_RANK": "x"})
    with pytest.raises(ConfigError, match=r"\$WORLD_SIZE='0' is not a number of peers"):
        require_size({"WORLD_SIZE": "0"})


def test_each_incarnation_has_its_own_key_prefix():
    first = Incarnation.from_env({"TORCHELASTIC_RUN_ID": "job7"})
    again = Incarnation.from_env({"TORCHELASTIC_RUN_ID": "job7",
                                  "TORCHELASTIC_RESTART_COUNT": "1"})
    requeued = Incarnation.from_env({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"})
    assert (first.prefix, again.prefix, requeued.prefix) == (
        "gossip/job7/0/", "gossip/job7/1/", "gossip/42/2/")


@pytest.mark.parametrize("env, prefix", [
    # Two steps of one allocation running at once (srun & srun).
    ({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"}, "gossip/42.0/0/"),
    ({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "1"}, "gossip/42.1/0/"),
    ({"SLURM_JOB_ID": "42", "SLURM_STEPID": "3", "SLURM_RESTART_COUNT": "1"}, "gossip/42.3/1/"),
    # mpirun: every launch is a new MPI job, inside an allocation or not; ranks on mpirun's
    # node and on the others (started by srun) see different SLURM steps, the same MPI job.
    ({"OMPI_MCA_ess_base_jobid": "3053387777"}, "gossip/3053387777/0/"),
    ({"OMPI_MCA_ess_base_jobid": "77", "SLURM_JOB_ID": "42"}, "gossip/77/0/"),
    ({"OMPI_MCA_ess_base_jobid": "77", "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "2"},
     "gossip/77/0/"),
    ({"PMIX_NAMESPACE": "prterun-n1-4242@1", "OMPI_MCA_ess_base_jobid": "77"},
     "gossip/prterun-n1-4242@1/0/"),
    ({"TORCHELASTIC_RUN_ID": "t", "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "2"}, "gossip/t/0/"),
])
def test_mpi_jobs_and_slurm_steps_have_their_own_key_prefix(env, prefix):
    assert Incarnation.from_env(env).prefix == prefix


def test_concurrent_slurm_steps_derive_different_store_ports():
    env = {"SLURM_STEP_NODELIST": "n[1-4]", "SLURM_JOB_ID": "123456"}
    ports = [Rendezvous.parse("slurm://", environ={**env, "SLURM_STEP_ID": str(step)}).port
             for step in range(4)]
    assert ports[0] == Rendezvous.parse("slurm://", environ=env).port == 23456
    assert len(set(ports)) == 4 and all(20000 <= port < 30000 for port in ports)
    with pytest.raises(ConfigError, match=r"\$SLURM_STEP_ID='batch' is not a SLURM step id"):
        Rendezvous.parse("slurm://", environ={**env, "SLURM_STEP_ID": "batch"})


@pytest.mark.parametrize("uri, env, message", [
    ("nccl://x:1", {}, "unknown scheme"),
    ("env", {}, "unknown scheme"),
    ("tcp://host", {}, "tcp:// needs HOST:PORT"),
    ("tcp://host:99999", {}, "out of range"),
    ("tcp://h:1?rank=x", {}, "rank='x' is not an integer"),
    ("tcp://h:1?color=red", {}, "unknown parameter 'color'"),
    ("file://relative/path", {}, "file:// needs an absolute path"),
    ("env://", {}, "$MASTER_ADDR and $MASTER_PORT not set"),
    ("env://", {"MASTER_ADDR": "h", "MASTER_PORT": "http"}, "$MASTER_PORT='http' is not a port"),
    ("slurm://", {"SLURM_JOB_ID": "5"}, "$SLURM_STEP_NODELIST, $SLURM_JOB_NODELIST"),
    ("slurm://", {"SLURM_JOB_NODELIST": "n[1-2]"}, "$SLURM_JOB_ID=''"),
    ("slurm://", {"SLURM_JOB_NODELIST": "n[1-2", "SLURM_JOB_ID": "5"}, "$SLURM_JOB_NODELIST"),
])
def test_a_bad_uri_or_environment_is_one_line_naming_it(uri, env, message):
    with pytest.raises(ConfigError) as info:
        Rendezvous.parse(uri, environ=env)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_uris_name_their_store():
    env = {"MASTER_ADDR": "head", "MASTER_PORT": "29400", "RANK": "3", "WORLD_SIZE": "8"}
    torchrun = Rendezvous.parse("env://", environ=env)
    assert (torchrun.host, torchrun.port, torchrun.rank_of(), torchrun.size_of()) == (
        "head", 29400, 3, 8)
    assert torchrun.rank_of(5) == 5  # --rank wins
    srun = Rendezvous.parse("slurm://", environ={
        "SLURM_STEP_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "123456", "SLURM_PROCID": "1",
        "SLURM_NTASKS": "3"})
    assert (srun.host, srun.port, srun.rank_of(), srun.size_of()) == ("gpu07", 23456, 1, 3)
    given = Rendezvous.parse("tcp://10.0.0.1:4000?rank=2&world_size=4", environ={})
    assert (given.host, given.port, given.rank_of(), given.size_of()) == ("10.0.0.1", 4000, 2, 4)
    assert Rendezvous.parse("file:///shared/store", environ={}).path == "/shared/store"


def test_contacts_round_trip_and_malformed_ones_name_the_rank():
    own = Contact("10.1.2.3", 41000, *this_machine())
    assert Contact.decode(0, own.encode()) == own
    assert own.endpoint == "tcp://10.1.2.3:41000"
    for bad in (b"not json", json.dumps({"host": "h", "port": 0}).encode()):
        with pytest.raises(RendezvousError, match="rank 4 published a malformed address"):
            Contact.decode(4, bad)


def test_an_unreachable_store_is_one_line_within_the_timeout():
    """It fails once the timeout it names is over, not at c10d's next connect backoff
    (which came at 1.6-2.3 times this timeout)."""
    port, timeout = free_ports(1)[0], 10.0
    rendezvous = Rendezvous.parse(f"tcp://127.0.0.1:{port}?world_size=2", environ={},
                                  timeout=timeout)
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        rendezvous.store(1, 2)
    assert 0.9 * timeout <= time.monotonic() - start < timeout + 3
    message = str(info.value)
    assert f"store tcp://127.0.0.1:{port} not reachable within 10 s" in message
    assert "\n" not in message


def test_a_store_that_comes_up_late_is_reached():
    """The wait for an unreachable store is a wait: a server that starts a moment later is
    reached, and the store works."""
    port = free_ports(1)[0]
    rendezvous = Rendezvous.parse(f"tcp://127.0.0.1:{port}?world_size=2", environ={},
                                  timeout=30.0)
    started = []
    timer = threading.Timer(1.0, lambda: started.append(_served_store(port)))
    timer.start()
    try:
        store = rendezvous.store(1, 2)
        store.set("k", b"v")
        assert started[0].get("k") == b"v"
    finally:
        timer.join()
        rendezvous.close(1, 2, wait=False)


def test_a_store_file_in_a_missing_directory_is_one_line_at_once(tmp_path):
    """torch's FileStore waits 300 s for the directory, whatever our timeout."""
    rendezvous = Rendezvous.parse(f"file://{tmp_path}/missing/store?world_size=2", environ={},
                                  timeout=60.0)
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        rendezvous.store(0, 2)
    assert time.monotonic() - start < 30
    assert str(info.value) == (
        f"--rendezvous file://{tmp_path}/missing/store?world_size=2: cannot open the store "
        f"file {tmp_path}/missing/store: No such file or directory (a directory every peer "
        f"sees must hold it)")


def _served_store(port: int):
    return dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=5),
                         wait_for_workers=False)


def test_a_stale_key_of_an_earlier_incarnation_is_never_read(run_peers):
    """The first incarnation published (rank 1 died after); the second one reads only its
    own keys: rank 1's old value stays unread, and waiting for its new one times out naming
    it."""
    port = free_ports(1)[0]
    server = _served_store(port)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "r"}
    uri = f"tcp://127.0.0.1:{port}?world_size=2"

    def meet(rank, restart, timeout=5.0):
        rendezvous = Rendezvous.parse(uri, environ={**env, "TORCHELASTIC_RESTART_COUNT":
                                                    str(restart)}, timeout=timeout)
        return rendezvous.exchange("address", rank, 2, f"{rank}@{restart}".encode())

    assert run_peers(2, lambda rank: meet(rank, 0)) == [[b"0@0", b"1@0"]] * 2
    with pytest.raises(RendezvousError, match=r"rank\(s\) 1 did not publish their address "
                                              r"within 1 s"):
        meet(0, 1, timeout=1.0)
    assert run_peers(2, lambda rank: meet(rank, 1)) == [[b"0@1", b"1@1"]] * 2
    del server


def test_an_mpi_relaunch_never_reads_the_aborted_attempts_addresses(tmp_path, run_peers):
    """mpirun with a file:// store: an attempt aborted after ranks 0 and 1 published; the
    relaunch (a new MPI job id, the same store file) reads only its own keys, so its rank 2
    waits for ranks 0 and 1 instead of reading their dead addresses, and meets them once
    they publish again."""
    uri = f"file://{tmp_path}/store?world_size=3"

    def rendezvous(rank, job, timeout=10.0):
        return Rendezvous.parse(uri, timeout=timeout, environ={
            "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "3",
            "OMPI_MCA_ess_base_jobid": job})

    def meet(rank, job, timeout=10.0):
        return rendezvous(rank, job, timeout).exchange("address", rank, 3,
                                                       f"{rank}@{job}".encode())

    for rank in (0, 1):  # published, then the attempt was aborted (rank 2 never came)
        dead = rendezvous(rank, "100")
        dead.store(rank, 3).set(f"{dead.incarnation.prefix}address/{rank}",
                                f"{rank}@100".encode())
    with pytest.raises(RendezvousError, match=r"rank\(s\) 0, 1 did not publish their "
                                              r"address within 1 s"):
        meet(2, "200", timeout=1.0)
    assert run_peers(3, lambda rank: meet(rank, "200")) == [[b"0@200", b"1@200", b"2@200"]] * 3


def test_two_checkpoint_generations_are_kept(tmp_path):
    path = checkpoint.path_for(tmp_path, 3)
    assert checkpoint.generations(path) == {}
    for round in (2, 4, 6):
        checkpoint.save(path, {**dict.fromkeys(checkpoint.REQUIRED[1:]), "rank": 3, "round": round})
    assert checkpoint.generations(path, rank=3) == {6: path, 4: checkpoint.previous(path)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer-3.prev.pt", "peer-3.pt"]
    with pytest.raises(CheckpointError, match="is for rank 3"):
        checkpoint.generations(path, rank=2)


@pytest.mark.parametrize("held, agreed, message", [
    ([[4, 6], [4, 6], [2, 4]], 4, None),
    ([[6, 8], [6, 8], [6, 8]], 8, None),
    ([[], [], []], None, None),  # killed before any checkpoint: start afresh
    ([[2, 4], [], [2, 4]], None, r"peer\(s\) 1 have no checkpoint"),
    ([[2, 4], [6, 8], [6, 8]], None, "no checkpoint round is kept by every peer "
                                     r"\(peer 0: 2, 4; peer 1: 6, 8; peer 2: 6, 8\)"),
])
def test_a_restarted_job_resumes_at_the_newest_round_every_peer_has(
        held, agreed, message, tmp_path, run_peers):
    uri = f"file://{tmp_path}/store?world_size=3"

    def agree(rank):
        rendezvous = Rendezvous.parse(uri, environ={}, timeout=10)
        try:
            return common_round(rendezvous, rank, 3, held[rank])
        except CheckpointError as exc:
            return str(exc)

    results = run_peers(3, agree)
    if message is None:
        assert results == [agreed] * 3
    else:
        assert all(isinstance(r, str) and re.search(message, r) for r in results), results


@pytest.mark.parametrize("args, env, message", [
    (["--rendezvous", "mpi://x"], {}, "error: --rendezvous 'mpi://x': unknown scheme"),
    (["--rendezvous", "env://"], {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "error: no rank: pass --rank or set one of $RANK, $SLURM_PROCID, "
     "$OMPI_COMM_WORLD_RANK, $PMI_RANK"),
    (["--rendezvous", "env://", "--rank", "0"], {"MASTER_ADDR": "127.0.0.1",
                                                 "MASTER_PORT": "1"},
     "error: no number of peers: give world_size= in the rendezvous URI or set one of "
     "$WORLD_SIZE, $SLURM_NTASKS, $OMPI_COMM_WORLD_SIZE, $PMI_SIZE"),
    (["--rendezvous", "tcp://127.0.0.1:1?world_size=3"], {"PMI_RANK": "1"},
     "error: rendezvous tcp://127.0.0.1:1?world_size=3: store tcp://127.0.0.1:1 not "
     "reachable within 1 s"),
    (["--advertise", "10.0.0.1", "--rank", "0"], {}, "error: --advertise: only with "
                                                     "--rendezvous"),
    (["--rendezvous", "file:///missing/dir/store"], {"RANK": "0", "WORLD_SIZE": "3"},
     "error: --rendezvous file:///missing/dir/store: cannot open the store file "
     "/missing/dir/store: No such file or directory"),
])
def test_gossip_peer_fails_in_one_line_naming_the_culprit(args, env, message, tmp_path,
                                                          monkeypatch):
    from click.testing import CliRunner

    from gossip.cli import main

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "ring.yaml").write_text("graph: {kind: ring}\n")
    result = CliRunner().invoke(main, ["peer", "--topology", str(tmp_path / "ring.yaml"),
                                       "--run-dir", str(tmp_path), "--timeout", "1", *args],
                                env=env)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith(message), lines[0]


@pytest.mark.parametrize("edges, env, message", [
    ("[[0, 1], [1, 2], [2, 3], [3, 0]]", {"RANK": "0", "WORLD_SIZE": "3"},
     "ring4.yaml: 4 peers (ranks 0..3), but the launcher started 3 ($WORLD_SIZE=3)"),
    ("[[0, 1], [1, 2], [2, 3], [3, 0]]", {"SLURM_PROCID": "0", "SLURM_NTASKS": "5"},
     "ring4.yaml: 4 peers (ranks 0..3), but the launcher started 5 ($SLURM_NTASKS=5)"),
])
def test_an_edge_list_of_another_size_than_the_launchers_names_the_variable(
        edges, env, message, tmp_path, monkeypatch):
    """Not "rank 3 is not a peer" or "graph is disconnected": the file is fine, the
    launcher's size is not its size."""
    from click.testing import CliRunner

    from gossip.cli import main

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "ring4.yaml").write_text(f"edges: {edges}\n")
    result = CliRunner().invoke(main, [
        "peer", "--topology", str(tmp_path / "ring4.yaml"), "--run-dir", str(tmp_path),
        "--timeout", "1", "--rendezvous", "tcp://127.0.0.1:1"], env=env)
    assert result.exit_code == 1
    assert result.output.strip() == f"error: {tmp_path}/{message}"
