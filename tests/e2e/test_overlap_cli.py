"""The overlap's command-line entry points as a user meets them."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_bad_task_path_on_the_command_line_is_one_line_and_exit_1(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gossip", "launch", "--task",
                             "no_such_pkg.tasks:build", "--overlap"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "task 'no_such_pkg.tasks:build': cannot import no_such_pkg.tasks" in errors[0]
