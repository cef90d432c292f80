"""Experiments: run several configurations one after the other, then plot and compare them.

``gossip experiment run FILE`` (spec.py: the file, runner.py: the runs) ends with the plot
step ``gossip plot RUN_DIR`` (analysis.py: curves and table, plots.py: PNGs, report.py).
"""

from gossip.experiment.report import report
from gossip.experiment.runner import run_experiment
from gossip.experiment.spec import Experiment, Run, load_experiment

__all__ = ["Experiment", "Run", "load_experiment", "report", "run_experiment"]
