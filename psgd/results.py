"""Reading run results for the analyses: one labelled run's seeds, small tables, curve statistics.

Contract: `groups_of(summaries)` loads every run of an experiment (summary.json + eval events) and
groups the seeds of each label into a `Group` (mean / spread / formatted "mean ± half-spread" of any
summary field, dotted keys allowed); `Section` is what an analysis returns for REPORT.md. Pure
reading and arithmetic: no plotting, no process.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from psgd import plots


@dataclass
class Section:
    id: str
    title: str
    claim: str
    quote: str
    verdict: str                 # confirmed | refuted | depends
    headline: str                # one line with the key number
    body: str                    # markdown: table and reasoning
    figures: list[Path] = field(default_factory=list)


@dataclass
class Group:
    """All seeds of one labelled run."""
    label: str
    runs: list[plots.RunData]

    @property
    def mode(self) -> str:
        return self.runs[0].mode

    @property
    def cfg(self) -> dict:
        return self.runs[0].summary["config"]

    def values(self, key: str) -> list[float]:
        out = []
        for r in self.runs:
            v = r.summary
            for part in key.split("."):
                v = v[part]
            out.append(float(v) if v is not None else float("nan"))
        return out

    def mean(self, key: str) -> float:
        return float(np.mean(self.values(key)))

    def spread(self, key: str) -> float:
        v = self.values(key)
        return float(max(v) - min(v)) if len(v) > 1 else 0.0

    def fmt(self, key: str, digits: int = 3) -> str:
        m, s = self.mean(key), self.spread(key)
        return f"{m:.{digits}f}" + (f" ± {s / 2:.{digits}f}" if len(self.runs) > 1 else "")


def groups_of(summaries: list) -> dict[str, Group]:
    grouped: dict[str, list] = defaultdict(list)
    for spec, _ in summaries:
        grouped[spec.label].append(plots.load_run(spec.cfg.out))
    return {label: Group(label, runs) for label, runs in grouped.items()}


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def roughness(run: plots.RunData) -> float:
    """Mean absolute change of test loss between consecutive evaluations (oscillation)."""
    losses = [e["test_loss"] for e in run.evals]
    if len(losses) < 3 or not all(math.isfinite(x) for x in losses):
        return float("inf")
    return float(np.mean(np.abs(np.diff(losses[len(losses) // 3:]))))  # after the initial descent


def diverged(run: plots.RunData) -> bool:
    first, last = run.evals[0]["test_loss"], run.summary["final_test_loss"]
    return last is None or not math.isfinite(last) or last > first


def time_to(run: plots.RunData, target: float) -> float:
    for e in run.evals:
        if e["test_accuracy"] >= target:
            return e["elapsed_s"]
    return float("inf")
