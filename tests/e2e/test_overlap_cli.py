"""The overlap's command-line entry points as a user meets them (in process: the command
exits before any peer starts)."""

from __future__ import annotations

from click.testing import CliRunner

from gossip.cli import main


def test_a_bad_task_path_on_the_command_line_is_one_line_and_exit_1(tmp_path):
    result = CliRunner().invoke(main, ["launch", "--task", "no_such_pkg.tasks:build",
                                       "--overlap", "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "task 'no_such_pkg.tasks:build': cannot import no_such_pkg.tasks" in errors[0]
