"""The "Writing a strategy" example of docs/ARCHITECTURE.md works as written: it registers,
passes the contract suite, and matches its own numpy oracle. Run in fresh interpreters, so
the example's registration does not leak into the other tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ORACLE = textwrap.dedent("""
    import threading, numpy as np, torch, gossip, ring_mean_example
    from gossip.ports import free_ports
    size, w = 5, 0.5
    topology = gossip.Topology.ring(size).relocated(ports=free_ports(size))
    x0 = torch.randn(size, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = [None] * size
    def peer(rank):
        with gossip.Peer(rank, topology, "ring-mean", timeout=10, weight=w) as p:
            x = x0[rank].clone()
            for round in range(3):
                x = p.synchronize(x, round, out=x)
            out[rank] = x
    threads = [threading.Thread(target=peer, args=(r,)) for r in range(size)]
    for t in threads: t.start()
    for t in threads: t.join(60)
    W = w * np.eye(size)
    for r in range(size):
        W[r, (r - 1) % size] += (1 - w) / 2
        W[r, (r + 1) % size] += (1 - w) / 2
    expected = np.linalg.matrix_power(W, 3) @ x0.numpy()
    np.testing.assert_allclose(torch.stack(out).numpy(), expected, rtol=1e-12, atol=1e-12)
    try:
        gossip.Peer(0, topology, "ring-mean", weight=2)
    except gossip.ConfigError as exc:
        assert "weight must be in [0, 1], got 2" in str(exc), exc
    else:
        raise AssertionError("a bad weight was accepted")
    print("oracle ok")
""")


def example_module(tmp_path: Path) -> dict[str, str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Writing a strategy", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    (tmp_path / "ring_mean_example.py").write_text(code)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_the_example_matches_its_oracle(tmp_path):
    env = example_module(tmp_path)
    done = subprocess.run([sys.executable, "-c", ORACLE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "oracle ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.slow
def test_the_example_joins_the_contract_suite_as_the_docs_say(tmp_path):
    env = example_module(tmp_path)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ring_mean_example",
                           "-p", "no:cacheprovider", "-k", "ring-mean",
                           str(ROOT / "tests" / "contract" / "test_strategy_contract.py")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"1[0-9] passed", done.stdout), done.stdout[-500:]
