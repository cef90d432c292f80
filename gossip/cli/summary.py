"""The table `gossip launch` and `gossip simulate` print at the end of a run: each finished
peer's figures, the consensus (probe or snapshots), the peers that died or were lost."""

from __future__ import annotations

import math
from pathlib import Path

# Record fields -> the columns that show them, when the peers' records have them.
_TEST_LOSS = {"test_loss": "test loss", "perplexity": "perplexity"}


def run_summary(run_dir: Path, ranks: list[int], deaths=()) -> str:
    """Per-peer table of the finished peers; the peers that died and the peers lost."""
    # Imported here, as every command's work is: `gossip --help` stays free of torch.
    from gossip.bench.harness import format_table
    from gossip.metrics import read_jsonl
    from gossip.training.snapshots import final_consensus

    died = {death.rank: death for death in deaths}
    rows, last = [], {}
    for rank in ranks:
        if rank in died or not (run_dir / f"peer-{rank}.jsonl").exists():  # or a server only
            continue
        records = read_jsonl(run_dir / f"peer-{rank}.jsonl")
        if not records:  # ended before its first round
            continue
        last[rank] = records[-1]
        tail = [r["loss"] for r in records[-10:] if r["loss"] is not None] or [float("nan")]
        rows.append({"peer": rank, "loss": sum(tail) / len(tail),
                     **{label: records[-1][key] for key, label in _TEST_LOSS.items()
                        if records[-1].get(key) is not None},
                     "accuracy": records[-1]["accuracy"], "bytes sent": records[-1]["bytes_sent"],
                     "bytes recv": records[-1]["bytes_recv"], "seconds": records[-1]["time"]})
    if not rows:  # e.g. every worker died and only a parameter server finished
        return "\n".join(["no peer finished training"] + [d.describe() for d in deaths])
    # a language model's records also hold its test loss and perplexity (Task.metrics)
    shown = [label for label in _TEST_LOSS.values() if all(label in r for r in rows)]
    table = format_table(rows, ["peer", "loss", *shown, "accuracy", "bytes sent", "bytes recv",
                                "seconds"])
    final = last[min(last)]
    # a peer that left or died between scored rounds (--test-every) has none last
    scored = [r["accuracy"] for r in rows if r["accuracy"] is not None] or [float("nan")]
    mean_acc = sum(scored) / len(scored)
    lines = [table, f"mean test accuracy {mean_acc:.4f}"]
    if shown:
        mean_loss = sum(r["test loss"] for r in rows) / len(rows)
        lines[-1] = (f"mean test loss {mean_loss:.4f} nats per target (perplexity "
                     f"{math.exp(mean_loss):.3f} at the mean); {lines[-1]}")
    if final["consensus"] is not None:
        lines[-1] += (f"; averaged model {final['avg_accuracy']:.4f}; consensus distance "
                      f"{final['consensus']:.3g}")
    elif any(record.get("lost_peers") for record in last.values()):
        lines[-1] += "; consensus not measured (a peer was lost)"  # the probe needs them all
    elif snapshot := final_consensus(run_dir / "snapshots"):  # an asynchronous run's
        when = "final models" if snapshot["tick"] is None else "last snapshot"
        lines[-1] += (f"; consensus distance {snapshot['consensus']:.3g} ({when} of "
                      f"{snapshot['peers']} peers, gossip.training.snapshots)")
    else:  # a rank only serves, or the strategy has no round all peers could probe in
        lines[-1] += ("; consensus not measured (a rank only serves, or an asynchronous "
                      "strategy)")
    lines += churn_summary(run_dir)
    lines += [death.describe() for death in deaths]
    # Every survivor's record of the peers it lost, and the round it noticed each in.
    noticed: dict[str, list[int]] = {}
    for record in last.values():
        for rank, round in (record.get("lost_peers") or {}).items():
            noticed.setdefault(rank, []).append(round)
    for rank, rounds in sorted(noticed.items(), key=lambda item: int(item[0])):
        lines.append(f"peer {rank} lost: noticed by {len(rounds)} of {len(last)} survivors "
                     f"in rounds {min(rounds)}-{max(rounds)}")
    return "\n".join(lines)


def churn_summary(run_dir: Path) -> list[str]:
    """A churn run's joins, leaves and kills (membership.jsonl): one line, or none."""
    from gossip.metrics import read_jsonl

    path = run_dir / "membership.jsonl"
    if not path.exists():
        return []
    done: dict[str, list[dict]] = {"join": [], "leave": [], "kill": []}
    for line in read_jsonl(path):
        done.setdefault(line["event"], []).append(line)
    parts = []
    for action, lines in done.items():
        if not lines:
            continue
        rounds = [e["round"] for e in lines]
        named = (", ".join(f"peer {e['rank']} at round {e['round']}" for e in lines)
                 if len(lines) <= 4 else f"rounds {min(rounds)}-{max(rounds)}")
        parts.append(f"{len(lines)} {action}{'s' if len(lines) > 1 else ''} ({named})")
    return [f"churn: {', '.join(parts)}"] if parts else []
