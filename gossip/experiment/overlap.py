"""The overlap table: each sync/overlap pair of arms against the time model of
docs/ARCHITECTURE.md (Overlap).

Runs named ``GROUP-sync[-K]`` and ``GROUP-overlap[-K]`` are the two arms of ``GROUP``
(repeats K interleaved A B A B); the first ``DROP`` rounds of each are left out and the
figures are medians over every peer's rounds of every repeat. Time model, from the sync arm:
C = compute_s (F + B; the emulated device's backward is twice its forward, so F = C/3),
M = comm_s (one full synchronization and the step), and for gradient strategies the last
(input-side) bucket's share of M by its share of the parameters, m_last (the overlap arm's
bucket plan, rebuilt from its config):

* sync: T_seq = C + M
* gradients (buckets during backward): T_wfbp = F + max(B, M) + m_last
* parameters (combine-then-adapt): T_cta = max(C, M)

The hidden fraction is (T_seq - T_ovl) / min(B or C, M): the share of what could hide that
did (1: all of it).
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gossip.metrics import read_jsonl

DROP = 3  # first rounds of every run: connections, caches, the first bucket plan
_ARM = re.compile(r"^(?P<group>.+)-(?P<arm>sync|overlap)(?:-\d+)?$")


def overlap_rows(run_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """One row per group that has both arms (none if no run is named like an arm)."""
    arms: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    kind: dict[str, str] = {}
    last_share: dict[str, float] = {}
    for run_dir in run_dirs:
        match = _ARM.match(run_dir.name)
        if not match:
            continue
        group = match["group"]
        arms[group][match["arm"]].extend(_rounds(run_dir))
        kind[group] = _operates_on(run_dir)
        if match["arm"] == "overlap" and kind[group] == "grads":
            last_share[group] = _last_bucket_share(run_dir)
    return [_row(group, found["sync"], found["overlap"], kind[group], last_share.get(group, 0))
            for group, found in arms.items() if found["sync"] and found["overlap"]]


def _rounds(run_dir: Path) -> list[dict]:
    lines = []
    for path in sorted(run_dir.glob("peer-*.jsonl")):
        lines += [line for line in read_jsonl(path) if line.get("round", 0) >= DROP
                  and line.get("compute_s") is not None]
    return lines


def _config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["train"]


def _operates_on(run_dir: Path) -> str:
    from gossip.strategies import STRATEGIES

    config = _config(run_dir)
    cls = STRATEGIES.strategy_class(config["strategy"], config.get("options") or {})
    return cls.operates_on


def _last_bucket_share(run_dir: Path) -> float:
    """The input-side bucket's share of the parameters in the run's bucket plan."""
    import torch

    from gossip.overlap import DEFAULT_BUCKET_MB, plan_buckets
    from gossip.tasks import create_task

    config = _config(run_dir)
    torch.manual_seed(0)
    model = create_task(config["task"], **(config.get("task_options") or {})).build_model()
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    plan = plan_buckets(numels, 4, bucket_mb=config.get("bucket_mb", DEFAULT_BUCKET_MB))
    return plan[-1].numel / sum(numels)


def _median(lines: list[dict], key: str) -> float:
    return statistics.median(line[key] for line in lines)


def _row(group: str, sync: list[dict], overlap: list[dict], operates_on: str,
         last_share: float) -> dict:
    c, m = _median(sync, "compute_s"), _median(sync, "comm_s")
    t_seq = statistics.median(line["compute_s"] + line["comm_s"] for line in sync)
    t_ovl = _median(overlap, "iter_s")
    f, b = c / 3, 2 * c / 3
    if operates_on == "grads":
        predicted_t = f + max(b, m) + m * last_share
        hideable = min(b, m)
    else:
        predicted_t = max(c, m)
        hideable = min(c, m)
    return {
        "group": group, "on": operates_on,
        "sync iter_s": t_seq, "overlap iter_s": t_ovl, "ratio": t_ovl / t_seq,
        "speedup": t_seq / t_ovl, "predicted": (c + m) / predicted_t,
        "sync compute_s": c, "sync comm_s": m,
        "overlap compute_s": _median(overlap, "compute_s"),
        "exposed_comm_s": _median(overlap, "exposed_comm_s"),
        "comm/compute": m / c if c else None,
        "hidden": (t_seq - t_ovl) / hideable if hideable else None,
        "rounds": f"{len(sync)}/{len(overlap)}",
    }
