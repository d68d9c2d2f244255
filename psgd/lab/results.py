"""Reading run results for the analyses: runs, seeds grouped by label, final figures, setups.

Contract:
- `load_run(out)` reads one finished run (summary.json + its eval events, ordered by version).
- `groups_of(summaries)` groups the seeds of each label into a `Group`. `Group.finals(key)` is,
  per seed, the mean of the last `LAST_K` evaluations of `key` (test_accuracy, test_loss, ...):
  one evaluation is noisy, the mean of a plateau is not. `Group.ci(key)` is its Student t
  interval over seeds (psgd/lab/stats.py); `Group.summary_ci(field)` the same for a summary field.
- `Group(scoring="best_val")` reads each seed's figure instead at its evaluation of best validation
  metric (`at_best_val`: the test metric where early stopping would stop; an experiment's `scoring`
  chooses, experiment.py); a run without validation metrics per evaluation is a clear error.
- `converged(run)` states the plateau criterion: the mean accuracy of the last LAST_K evaluations
  differs from the LAST_K before by less than PLATEAU (validation accuracy when the run has a
  validation split, else test). The report counts converged seeds per run.
- `setup(cfg)` is the sentence that describes a run's configuration, built from the config (never
  typed), and `Section` is what an analysis returns for REPORT.md.
Pure reading and arithmetic: no plotting, no process.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from psgd.lab import stats

LAST_K = 3          # evaluations averaged into a final figure
# Accuracy change between the last two windows of LAST_K that counts as converged. 0.02: one
# evaluation on 800 validation samples has a sampling error of about 0.017 at 60% accuracy, so a
# smaller threshold would call noise a trend.
PLATEAU = 0.02
DATASET_NAMES = {"mnist1d": "MNIST-1D", "synthetic": "synthetic teacher data", "mnist": "MNIST"}
MODEL_NAMES = {"logreg": "logistic regression", "mlp": "MLP", "cnn": "1-D CNN", "wide_mlp": "wide MLP"}


@dataclass
class RunData:
    summary: dict
    evals: list[dict]

    @property
    def mode(self) -> str:
        return self.summary["mode"]

    @property
    def cfg(self) -> dict:
        return self.summary["config"]


def load_run(out: str | Path) -> RunData:
    out = Path(out)
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{out}: no summary.json (is this a finished run folder?)")
    summary = json.loads(summary_path.read_text())
    evals = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        if not line.strip():  # a process that opened the file as another appended ended a line it took for torn
            continue
        e = json.loads(line)
        if e.get("event") == "eval" and "version" in e:
            evals.append(e)
    evals.sort(key=lambda e: e["version"])
    return RunData(summary, evals)


def final(run: RunData, key: str = "test_accuracy", k: int = LAST_K) -> float:
    """Mean of `key` over the last k evaluations (nan when the run has none or it is not finite)."""
    tail = [e.get(key) for e in run.evals[-k:]]
    tail = [float(v) for v in tail if v is not None]
    if not tail:
        return float("nan")
    return float(np.mean(tail)) if all(math.isfinite(v) for v in tail) else float("nan")


def best_val_index(run: RunData, val_key: str = "val_accuracy") -> int:
    """The evaluation with the best validation metric (the highest accuracy, or the lowest loss for a
    `val_loss`; ties: the earliest), where early stopping would keep the model. A clear error for a
    run whose evaluations record no validation metric (made without --val-fraction)."""
    vals = [(i, e.get(val_key)) for i, e in enumerate(run.evals)]
    vals = [(i, float(v)) for i, v in vals if v is not None and math.isfinite(float(v))]
    if not vals:
        where = run.summary.get("config", {}).get("out") or "a run"
        raise ValueError(f"{where}: its evaluations record no finite {val_key}: best-validation scoring needs "
                         f"runs made with a validation split (--val-fraction > 0)")
    lower = val_key.endswith("loss")
    return min(vals, key=lambda iv: (iv[1] if lower else -iv[1], iv[0]))[0]


def at_best_val(run: RunData, key: str = "test_accuracy", val_key: str = "val_accuracy") -> float:
    """`key` (a test metric) at the evaluation of best validation metric (nan when not finite there)."""
    v = run.evals[best_val_index(run, val_key)].get(key)
    return float(v) if v is not None and math.isfinite(float(v)) else float("nan")


def up_to(g: Group, samples: int) -> Group:
    """The same runs as if their budget ended at `samples`: only the evaluations made by then (a
    constant rate has no schedule, so a run's state there is a shorter run's final state)."""
    runs = [RunData(r.summary, [e for e in r.evals if e.get("samples", 0) <= samples]) for r in g.runs]
    return Group(g.label, runs, g.scoring, g.val_key)


def converged(run: RunData, k: int = LAST_K, tol: float = PLATEAU) -> bool:
    key = "val_accuracy" if run.evals and run.evals[-1].get("val_accuracy") is not None else "test_accuracy"
    acc = [e[key] for e in run.evals]
    if len(acc) < 2 * k:
        return False
    return abs(float(np.mean(acc[-k:])) - float(np.mean(acc[-2 * k:-k]))) < tol


FAILED_LOSS = 0.95   # a final loss above this fraction of the initial loss: no progress


def diverged(run: RunData) -> bool:
    """Failed to train: the final TRAINING loss is not finite, or the run ended no better than it
    started (above FAILED_LOSS x the initial training loss; a model that collapsed to one class sits
    at ln 10, the initial loss, not above it). Decided on the training loss, never the test loss: a
    run that overfits (test loss rising while it learns) has not diverged."""
    key = "train_loss" if run.evals and run.evals[0].get("train_loss") is not None else "test_loss"
    last = final(run, key, 1)
    return not math.isfinite(last) or (bool(run.evals) and last > FAILED_LOSS * run.evals[0][key])


def time_to(run: RunData, target: float, key: str = "test_accuracy") -> float:
    """Seconds of steady-state training until `key` first reached `target` (inf: never)."""
    for e in run.evals:
        if e[key] >= target:
            return e["elapsed_s"]
    return float("inf")


def roughness(run: RunData, key: str = "test_loss") -> float:
    """Mean |change of `key`| between consecutive evaluations after the first third (oscillation).
    Only comparable between runs evaluated on the same grid of samples (the suite's eval_samples)."""
    v = [e[key] for e in run.evals]
    if len(v) < 3 or not all(math.isfinite(x) for x in v):
        return float("inf")
    return float(np.mean(np.abs(np.diff(v[len(v) // 3:]))))


@dataclass
class Group:
    """All seeds of one labelled run, in seed order (so that two arms' per-seed lists pair up)."""
    label: str
    runs: list[RunData]
    scoring: str = "end"          # "end": mean of the last LAST_K evaluations; "best_val": at the best validation point
    val_key: str = "val_accuracy"  # the validation metric "best_val" picks by

    def __post_init__(self) -> None:
        self.runs = sorted(self.runs, key=lambda r: r.cfg.get("seed", 0))

    @property
    def seeds(self) -> list[int]:
        return [r.cfg.get("seed", 0) for r in self.runs]

    @property
    def mode(self) -> str:
        return self.runs[0].mode

    @property
    def cfg(self) -> dict:
        return self.runs[0].cfg

    @property
    def lr(self) -> float:
        return float(self.cfg["optim"]["lr"])

    def values(self, key: str) -> list[float]:
        """A summary field per seed (dotted keys allowed: staleness.mean)."""
        out = []
        for r in self.runs:
            v = r.summary
            for part in key.split("."):
                v = v[part]
            out.append(float(v) if v is not None else float("nan"))
        return out

    def mean(self, key: str) -> float:
        return float(np.mean(self.values(key)))

    def finals(self, key: str = "test_accuracy") -> list[float]:
        """Each seed's final figure of `key`, as the claim scores it (`scoring`)."""
        if self.scoring == "best_val":
            return [at_best_val(r, key, self.val_key) for r in self.runs]
        return [final(r, key) for r in self.runs]

    def ci(self, key: str = "test_accuracy") -> stats.Interval:
        return stats.mean_ci(self.finals(key))

    def summary_ci(self, key: str) -> stats.Interval:
        return stats.mean_ci(self.values(key))

    def converged(self) -> str:
        return f"{sum(converged(r) for r in self.runs)}/{len(self.runs)}"


def groups_of(summaries: list, scoring: str = "end", val_key: str = "val_accuracy") -> dict[str, Group]:
    grouped: dict[str, list] = defaultdict(list)
    for spec, _ in summaries:
        grouped[spec.label].append(load_run(spec.cfg.out))
    return {label: Group(label, runs, scoring, val_key) for label, runs in grouped.items()}


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def setup(cfg: dict, vary: tuple[str, ...] = ()) -> str:
    """One sentence describing a run's configuration, from its config; `vary` names what the
    experiment varies (left out of the sentence)."""
    d, m, o = cfg["data"], cfg["model"], cfg["optim"]
    n = d["num_samples"]
    test = n - int(n * 0.8) if d["dataset"] in ("mnist1d", "synthetic") else None
    train = int(n * 0.8) if test is not None else None
    parts = []
    model = MODEL_NAMES.get(m["model"], m["model"]) + (f" (width {m['width']})" if m["width"] else "")
    if train is not None:
        val = round(train * d.get("val_fraction", 0.0))
        split = f"{train - val:,} train" + (f" / {val:,} validation" if val else "") + f" / {test:,} test samples"
        parts.append(f"{model} on {DATASET_NAMES.get(d['dataset'], d['dataset'])} ({split})")
    else:
        parts.append(f"{model} on {DATASET_NAMES.get(d['dataset'], d['dataset'])}")
    if "mode" not in vary:
        parts.append(f"mode {cfg['mode']}")
    if "workers" not in vary:
        parts.append(f"{cfg['workers']} worker{'s' * (cfg['workers'] != 1)}")
    if cfg["mode"] != "allreduce" and "servers" not in vary:
        parts.append(f"{cfg['servers']} shard{'s' * (cfg['servers'] != 1)} over {cfg['transport']}")
    if "batch_size" not in vary:
        parts.append(f"batch {cfg['batch_size']} per worker")
    budget = f"{cfg['epochs']:g} epochs" if cfg["epochs"] else f"{cfg['steps']} steps per worker"
    if "epochs" not in vary:
        parts.append(budget)
    if o.get("optimizer", "sgd") == "adamw":
        opt = f"AdamW, betas ({o.get('beta1', 0.9):g}, {o.get('beta2', 0.999):g})"
    else:
        opt = f"SGD, momentum {o['momentum']:g}"
    opt += f", weight decay {o['weight_decay']:g}" if o["weight_decay"] else ""
    if cfg.get("local_steps", 1) > 1 or "local_steps" in vary:
        opt += f"; outer step {o.get('outer', 'sgd')} (local SGD / DiLoCo)"
    if "lr" not in vary:
        opt += f", lr {o['lr']:g}"
    parts.append(opt)
    if cfg.get("cpu_quota"):
        parts.append(f"every process limited to {cfg['cpu_quota']:g} cores by a kernel CPU quota (--cpu-quota)")
    if d.get("shard_data", "iid") != "iid" and "shard_data" not in vary:
        parts.append(f"{d['shard_data']} shards")
    return "; ".join(parts)


@dataclass
class Figure:
    path: Path
    caption: str


class Finding(NamedTuple):
    """What an analysis returns: its verdict (psgd/lab/verdicts.py), the headline with the key number,
    the report's text, the figures and the key numbers for summary.json. A NamedTuple, so the older
    analyses' bare 5-tuples read the same way."""
    verdict: Any
    headline: str
    text: str
    figures: list[Figure]
    key: dict


@dataclass
class Section:
    id: str
    title: str
    claim: str
    quote: str
    verdict: str                 # one of psgd.lab.verdicts.OUTCOMES
    headline: str                # one line with the key number (and its interval)
    body: str                    # markdown: setup, tuning, table, rule and reasoning
    figures: list[Figure] = field(default_factory=list)
    key: dict = field(default_factory=dict)   # numbers for results/summary.json
    why: str = ""
    quote_en: str = ""           # the quote's English translation ("" when the quote is English)
    quote_source: str = ""       # where the quote is from: a seed article's number ("000") or a citation
    effects: tuple = ()          # the verdict's psgd.lab.verdicts.Effect parts (the forest plot's rows)
    halves: dict | None = None   # the split-half verdicts (analyses.split_half); None: not computed
    power: dict | None = None    # the seeds the power rule asks for (power.claim_power); None: none weighed
    scoring: str = ""            # how its runs were scored: "end" or "best_val" ("" for a benchmark)
    by_construction: str = ""    # why the configuration fixes its outcome: a check of psgd, not a finding
