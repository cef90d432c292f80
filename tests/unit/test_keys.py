"""CURVE keys: `gossip keys generate`, key files, topology fields, and picking a rank's keys."""

from __future__ import annotations

import stat

import pytest
import yaml
import zmq
from click.testing import CliRunner

from gossip import keys
from gossip.cli import main
from gossip.errors import ConfigError, TopologyError
from gossip.peer import Peer
from gossip.topology import Topology


@pytest.fixture
def key_dir(tmp_path):
    keys.generate(tmp_path / "keys", range(3))
    return tmp_path / "keys"


def ring_yaml(path, **extra) -> str:
    path.write_text(yaml.safe_dump({"size": 3, "base_port": 7100, "graph": {"kind": "ring"},
                                    **extra}))
    return str(path)


def explicit_peers(public: list[str | None]) -> dict:
    return {"peers": [{"rank": r, "host": "127.0.0.1", "port": 7200 + r,
                       **({"public_key": key} if key is not None else {})}
                      for r, key in enumerate(public)],
            "graph": {"kind": "ring"}}


# -- key files --------------------------------------------------------------------------------


def test_generate_writes_a_private_secret_and_its_public_key(key_dir):
    for rank in range(3):
        secret_file, public_file = keys.secret_path(key_dir, rank), keys.public_path(key_dir, rank)
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        assert not public_file.stat().st_mode & stat.S_IWOTH
        secret, public = keys.read_secret_key(secret_file), keys.read_public_key(public_file)
        assert len(secret) == len(public) == keys.KEY_CHARS
        assert zmq.curve_public(secret.encode()).decode() == public
    publics = {keys.read_public_key(keys.public_path(key_dir, r)) for r in range(3)}
    assert len(publics) == 3


def test_generate_does_not_overwrite_unless_forced(key_dir):
    before = keys.public_path(key_dir, 1).read_text()
    with pytest.raises(ConfigError, match=r"peer-0.key: exists already \(pass --force"):
        keys.generate(key_dir, range(2))
    assert keys.public_path(key_dir, 1).read_text() == before
    keys.generate(key_dir, range(2), force=True)
    assert keys.public_path(key_dir, 1).read_text() != before


def test_a_secret_key_others_may_read_is_refused(key_dir):
    path = keys.secret_path(key_dir, 0)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"readable by others \(mode 0644\); run chmod 600"):
        keys.read_secret_key(path)


@pytest.mark.parametrize("text, problem", [
    ("", "expected one Z85 key line, found 0"),
    ("abc\n", "expected a 40-character Z85 CURVE key, got 3 characters"),
    ("a" * 39 + "~\n", "'~' is not a Z85 character"),
    ("a" * 40 + "\n" + "b" * 40 + "\n", "found 2"),
])
def test_malformed_key_files_name_the_file(tmp_path, text, problem):
    path = tmp_path / "peer-0.key.pub"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{path}: .*{problem}"):
        keys.read_public_key(path)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'nope'}: no such key file"):
        keys.read_public_key(tmp_path / "nope")


# -- topology fields --------------------------------------------------------------------------


def test_keys_directory_is_relative_to_the_topology_file(key_dir, tmp_path):
    topo = Topology.from_yaml(ring_yaml(tmp_path / "ring.yaml", keys="keys"))
    assert topo.keyed and topo.key_dir == key_dir.resolve()
    assert [p.public_key for p in topo.peers] == [
        keys.read_public_key(keys.public_path(key_dir, r)) for r in range(3)]
    assert "CURVE keys in" in topo.describe()


@pytest.mark.parametrize("form", ["keys directory", "public_key per peer"])
def test_keys_survive_the_round_trip_and_relocation(key_dir, form):
    if form == "keys directory":
        topo = Topology.generate("ring", 3).with_keys(key_dir)
    else:
        public = [keys.read_public_key(keys.public_path(key_dir, r)) for r in range(3)]
        topo = Topology.from_dict(explicit_peers(public))
    data = topo.to_dict()
    assert ("keys" in data) == (form == "keys directory")
    assert ("public_key" in data["peers"][0]) == (form != "keys directory")
    again = Topology.from_dict(yaml.safe_load(yaml.safe_dump(data)))
    assert again == topo and again.key_dir == topo.key_dir
    moved = topo.relocated(ports=[9000, 9001, 9002])
    assert [p.public_key for p in moved.peers] == [p.public_key for p in topo.peers]
    assert moved.key_dir == topo.key_dir


def test_topology_without_keys_is_plaintext():
    topo = Topology.ring(3)
    assert not topo.keyed and topo.key_dir is None
    assert "public_key" not in topo.to_dict()["peers"][0] and "keys" not in topo.to_dict()


KEY_A, KEY_B = (zmq.curve_keypair()[0].decode() for _ in range(2))


KEY_FORMAT = r"expected a 40-character Z85 CURVE key, got"


@pytest.mark.parametrize("public, problem", [
    ([KEY_A, None, KEY_B], r"peers\[1\].public_key: missing \(peers\[0\] has one: give every"),
    ([None, None, KEY_A], r"peers\[0\].public_key: missing \(peers\[2\] has one"),
    ([KEY_A, "short", KEY_B], rf"peers\[1\].public_key: {KEY_FORMAT} 5 characters"),
    ([KEY_A, 12345, KEY_B], rf"peers\[1\].public_key: {KEY_FORMAT} int"),
    ([KEY_A, KEY_B, KEY_A], r"peers\[2\].public_key: same key as peers\[0\]"),
])
def test_bad_public_keys_name_the_field(public, problem):
    with pytest.raises(TopologyError, match=f"^t.yaml: {problem}"):
        Topology.from_dict(explicit_peers(public), source="t.yaml")


def test_bad_keys_directory_names_the_field(tmp_path, key_dir):
    with pytest.raises(TopologyError, match=r"ring.yaml: keys: .*missing is not a directory "
                                            r"\(create one with `gossip keys generate --out "
                                            r"missing --peers 3`\)"):
        Topology.from_yaml(ring_yaml(tmp_path / "ring.yaml", keys="missing"))
    keys.public_path(key_dir, 2).unlink()
    with pytest.raises(TopologyError, match=r"ring.yaml: keys: .*peer-2.key.pub: no such key"):
        Topology.from_yaml(ring_yaml(tmp_path / "ring.yaml", keys="keys"))
    with pytest.raises(TopologyError, match="keys: expected a directory"):
        Topology.from_yaml(ring_yaml(tmp_path / "ring.yaml", keys=3))
    data = {**explicit_peers([KEY_A, KEY_B, zmq.curve_keypair()[0].decode()]), "keys": "keys"}
    (tmp_path / "both.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(TopologyError, match="give either 'keys' .* or a public_key per peer"):
        Topology.from_yaml(tmp_path / "both.yaml")


# -- one rank's keys --------------------------------------------------------------------------


def test_a_rank_finds_its_secret_in_the_key_directory(key_dir):
    topo = Topology.ring(3).with_keys(key_dir)
    mine = keys.for_rank(topo, 1)
    assert mine.rank == 1 and mine.public == topo.peers[1].public_key
    assert mine.peers == tuple(p.public_key for p in topo.peers)
    assert mine.rank_of(topo.peers[2].public_key) == 2 and mine.rank_of(KEY_A) is None
    assert mine.secret not in repr(mine)
    assert keys.for_rank(Topology.ring(3), 1) is None


def test_a_secret_key_of_another_rank_is_refused(key_dir):
    topo = Topology.ring(3).with_keys(key_dir)
    wrong = keys.secret_path(key_dir, 2)
    with pytest.raises(ConfigError, match=rf"{wrong}: not rank 1's secret key \(its public key "
                                          r".* differs from peers\[1\].public_key"):
        keys.for_rank(topo, 1, wrong)


def test_explicit_public_keys_need_a_key_file(key_dir):
    public = [keys.read_public_key(keys.public_path(key_dir, r)) for r in range(3)]
    topo = Topology.from_dict(explicit_peers(public))
    with pytest.raises(ConfigError, match="rank 0: the topology lists public keys but no key "
                                          "directory: pass --key FILE"):
        keys.for_rank(topo, 0)
    assert keys.for_rank(topo, 0, keys.secret_path(key_dir, 0)).public == public[0]
    with pytest.raises(ConfigError, match="the topology lists no public keys"):
        keys.for_rank(Topology.ring(3), 0, keys.secret_path(key_dir, 0))


def test_peer_with_a_missing_secret_fails_before_binding(key_dir):
    keys.secret_path(key_dir, 1).unlink()
    topo = Topology.ring(3).with_keys(key_dir)
    with pytest.raises(ConfigError, match="peer-1.key: no such key file"):
        Peer(1, topo, "dpsgd")


# -- command line ------------------------------------------------------------------------------


def test_cli_generates_one_keypair_per_rank(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["keys", "generate", "--out", str(tmp_path / "k"),
                                  "--peers", "2"])
    assert result.exit_code == 0, result.output
    assert "2 keypairs" in result.output
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [
        "peer-0.key", "peer-0.key.pub", "peer-1.key", "peer-1.key.pub"]
    topo_file = ring_yaml(tmp_path / "ring.yaml")
    result = runner.invoke(main, ["keys", "generate", "--out", str(tmp_path / "t"),
                                  "--topology", topo_file])
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "t").glob("*.key"))) == 3


@pytest.mark.parametrize("args, culprit", [
    ([], "give exactly one of --peers N or --topology FILE"),
    (["--peers", "2", "--topology", "x.yaml"], "give exactly one of"),
    (["--peers", "0"], "--peers: expected a positive number, got 0"),
    (["--topology", "missing.yaml"], "missing.yaml: no such file"),
])
def test_cli_bad_input_is_one_line(tmp_path, args, culprit):
    result = CliRunner().invoke(main, ["keys", "generate", "--out", str(tmp_path / "k"), *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: ")
    assert culprit in lines[0]
