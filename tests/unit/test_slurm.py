"""SLURM node lists, in every form srun writes them (SLURM's own expansion as the oracle)."""

from __future__ import annotations

import pytest

from gossip import slurm
from gossip.errors import ConfigError


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[572-578]", [f"node{n}" for n in range(572, 579)]),
    ("a[01-03,07],b5", ["a01", "a02", "a03", "a07", "b5"]),
    ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),  # padding kept past 99
    ("login", ["login"]),
    ("n[7]", ["n7"]),
    ("x-[1-2].cluster,y", ["x-1.cluster", "x-2.cluster", "y"]),
])
def test_node_lists_expand_in_slurm_order(nodelist, hosts):
    assert slurm.expand(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "  ", "a[01-03", "a[3-1]", "a[]", ","])
def test_a_malformed_node_list_is_one_line_naming_it(nodelist):
    with pytest.raises(ConfigError) as info:
        slurm.expand(nodelist, source="$SLURM_JOB_NODELIST")
    message = str(info.value)
    assert message.startswith(f"$SLURM_JOB_NODELIST {nodelist!r}") and "\n" not in message


def test_the_first_node_comes_from_the_most_specific_list():
    env = {"SLURM_JOB_NODELIST": "a[1-4]", "SLURM_STEP_NODELIST": "a[3-4]"}
    assert slurm.first_node(env) == "a3"
    assert slurm.first_node({"SLURM_JOB_NODELIST": "b[07-09]"}) == "b07"
    with pytest.raises(ConfigError, match=r"\$SLURM_STEP_NODELIST, \$SLURM_JOB_NODELIST, "
                                          r"\$SLURM_NODELIST"):
        slurm.first_node({})
