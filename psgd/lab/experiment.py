"""Experiment files: the TOML schema of one claim, parsed into run plans (no process, no I/O but reading).

Contract:
- An experiment file is one claim: `id`, `title`, `claim`, `quote` (the seed article's words,
  copied verbatim from one article; "……" marks a trim inside the passage; tools/check_quotes.py
  checks them against the seed texts), `quote_en` (their English translation, printed under them
  in the report; needs `quote`), `quote_source` (where the quote is from: a seed article's number,
  "000" for shared/seeds/000_*.txt, printed as "seed article 000", or another source's citation;
  needs `quote`),
  `analysis` (which analysis in psgd/analyses*.py reads its runs), `why` (why these models, data
  and budgets make the effect visible), `seeds`, a `[base]` table of run settings, `[[runs]]`
  (each a `label` plus settings that override base), optional `[params]` for the analysis,
  `[tune]`, and `[profiles.quick]` / `[profiles.full]` / `[profiles.reference]` overrides of base
  (and of `seeds`, `tune`, `params`; `runs` in a profile are added; the reference profile sets only
  `seeds`, sized by the power rule: psgd/lab/power.py). Optional per-claim metadata, which changes
  no run: `margin_why` (why the verdict's margin is the smallest effect of interest, printed beside
  the seeds the power rule asks for), `[margin]` (that smallest effect of interest per unit,
  `accuracy`, `ratio`, `nats`, `share`: fixed here, at the top level only, so the same at every
  profile and n; the analysis's rule must weigh its parts against it) and `scoring` ("end", the
  default: each run's final figure is the mean of its last evaluations; "best_val": the test
  figure at the evaluation of its best validation metric, `[tune] metric`, as early stopping reads
  it; needs a validation split). A
  suite file's `[base]` and profile tables sit under the experiment's own. A benchmark experiment
  has `bench = "NAME"` and `[bench_args]` (flags; true = a bare flag, "{out}" = the experiment's
  results folder) instead of runs.
  Settings are RunConfig field names (`workers`, `lr`, `straggler = ["0=40"]`, ...); a bad key
  or value is a one-line SuiteError naming the file and the key. A list where a single value is
  expected makes a grid: `workers = [1, 4]` and `lr = [0.1, 1.0]` give four runs, and the label
  is a format string (`label = "async N={workers} lr={lr}"`).
- `eval_samples` (in base or a run) puts every run on one grid of training samples: each run's
  `--eval-every` becomes eval_samples / (samples per update of that run).
- `[tune] lr = [...]`: every run without an explicit `lr` is swept over the grid (seeds
  `[tune] seeds`, at least 3, default 100-102, kept apart from the evaluation seeds) and scored on
  the validation split (`val_fraction`); a pick at an end of its grid grows the grid past that end
  (psgd/lab/tuning.py); `choose` picks the best mean over seeds of the last `last_k` validation accuracies
  (`[tune] metric = "val_loss"`: the lowest mean validation loss, for a language model) (ties:
  the smaller rate). A run may name its own grid (`tune_lr = [...]`), take another label's chosen
  rate (`lr_from = "sync"`, optionally times `lr_factor`), or opt out (`tune = false`).
- `Experiment.tune_specs()` and `.final_specs(chosen)` give the runs, each in
  `RESULTS/runs/<digest>/`, the digest of its config and the code version (`run_digest`).
- The files are read and checked by psgd/lab/loader.py (`load_experiment`, `load_suite`), their
  settings by psgd/lab/settings.py; `score` and `choose` are the tuning rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from psgd.core import config as C
from psgd.lab.settings import SuiteError, config_from_settings
from psgd.train.metrics import read_events, samples_per_update

__all__ = ["TUNE_METRICS", "TUNE_MIN_SEEDS", "PROFILES", "SCORINGS", "SuiteError", "RunSpec", "RunTemplate",
           "Experiment", "run_digest", "score", "choose"]

TUNE_MIN_SEEDS = 3   # tuning scores the mean over at least this many seeds (psgd/lab/tuning.py)
TUNE_METRICS = ("val_accuracy", "val_loss")  # what tuning scores (higher accuracy, or lower loss, wins)
PROFILES = ("default", "quick", "full", "reference")
# How a run's final figure is read (results.py): "end", the mean of its last evaluations (the budget's
# end); "best_val", the test figure at its evaluation of best validation metric (early stopping).
SCORINGS = ("end", "best_val")


@dataclass(frozen=True)
class RunSpec:
    experiment: str
    label: str
    seed: int
    cfg: C.RunConfig
    phase: str = "final"          # final | tune (a point of a learning-rate sweep)
    version: str = ""             # code version that must have made a reusable result
    sim: dict = field(default_factory=dict)  # a simulated run's SimConfig fields (psgd/sim/); {}: a real run

    @property
    def command(self) -> str:
        sim = ["--simulate"] + [a for k, v in self.sim.items() for a in (f"--sim-{k}", v)] if self.sim else []
        return "psgd run " + shlex.join(C.to_argv(self.cfg) + sim)


@dataclass(frozen=True)
class RunTemplate:
    """One [[runs]] entry after grid expansion: settings without seed and out, and how its lr is set."""
    label: str
    settings: dict
    lr_grid: tuple[float, ...] = ()   # tuned over this grid (empty: not tuned)
    lr_from: str = ""                 # or: the chosen rate of another label ...
    lr_factor: float = 1.0            # ... times this
    eval_samples: int = 0
    sim: dict = field(default_factory=dict)  # simulate = true: its time model's settings (settings.py `sim_settings`)


@dataclass(frozen=True)
class Experiment:
    id: str
    title: str
    claim: str
    quote: str
    analysis: str
    path: Path
    why: str = ""
    seeds: tuple[int, ...] = (0,)
    templates: tuple[RunTemplate, ...] = ()
    tune_seeds: tuple[int, ...] = (100, 101, 102)
    tune_last_k: int = 3
    tune_metric: str = "val_accuracy"
    results: Path = Path("results")
    version: str = ""
    bench: str = ""
    bench_args: tuple[str, ...] = ()
    params: dict = field(default_factory=dict)
    quote_en: str = ""                # the quote in English ("" when the quote is English already)
    quote_source: str = ""            # a seed article's number ("000") or another source's citation
    margin_why: str = ""              # why the claim's margin is its smallest effect of interest
    scoring: str = "end"              # SCORINGS: at the budget's end, or at the best validation point
    by_construction: str = ""         # why the configuration fixes the outcome ("": a finding that can go either way)
    margins: dict = field(default_factory=dict)   # [margin]: verdict unit -> the smallest effect of interest
    tune_added: dict = field(default_factory=dict)  # label -> rates the sweep added past its grid (tuning.py)

    @property
    def tuned(self) -> bool:
        return any(t.lr_grid for t in self.templates)

    def tune_specs(self) -> list[RunSpec]:
        """Every point of every sweep (validation only)."""
        return [self._spec(t, seed, lr, "tune") for t in self.templates for lr in t.lr_grid
                for seed in self.tune_seeds]

    def final_specs(self, chosen: dict[str, float]) -> list[RunSpec]:
        """The evaluated runs, with the chosen rates filled in."""
        specs = []
        for t in self.templates:
            lr = self.rate_of(t, chosen)
            specs += [self._spec(t, seed, lr, "final") for seed in self.seeds]
        return specs

    def planned_specs(self) -> list[RunSpec]:
        """The evaluated runs before tuning, each tuned label at its grid's first rate: for
        validating configs and sizing the plan (the real rates are known only after tuning)."""
        return self.final_specs({t.label: t.lr_grid[0] for t in self.templates if t.lr_grid})

    def rate_of(self, t: RunTemplate, chosen: dict[str, float]) -> float | None:
        if t.lr_grid:
            return chosen[t.label]
        if t.lr_from:
            return chosen[t.lr_from] * t.lr_factor
        return None

    def _spec(self, t: RunTemplate, seed: int, lr: float | None, phase: str) -> RunSpec:
        settings = dict(t.settings, seed=seed)
        if lr is not None:
            settings["lr"] = float(lr)
        where = f"{self.path} [[runs]] {t.label!r}"
        cfg = config_from_settings(settings, where)
        if cfg.eval_every == C.AUTO:  # the suites' runs keep the interval they were made with (their digests too)
            cfg = dataclasses.replace(cfg, eval_every=C.EVAL_EVERY_MIN)
        if t.eval_samples:
            per = samples_per_update(cfg)
            if t.eval_samples % per:
                raise SuiteError(f"{where}: eval_samples {t.eval_samples} is not a multiple of the {per} samples "
                                 f"of one update")
            cfg = dataclasses.replace(cfg, eval_every=t.eval_samples // per)
        if phase == "tune" and cfg.mode != "allreduce":
            # A rate at a grid's edge may diverge, and where it does depends on the CPU (sync runs
            # reproduce bit for bit per machine and torch build, not across them: E0's CNN at lr 0.3
            # diverges at update 374 on one machine and not on another). A diverged tuning run is a
            # poor score (its shards skip the non-finite gradients), never a failed suite; a run
            # that stays finite is the same run either way.
            cfg = dataclasses.replace(cfg, skip_nonfinite=True)
        cfg = dataclasses.replace(cfg, out=str(self.results / "runs" / run_digest(cfg, self.version, t.sim)))
        return RunSpec(self.id, t.label, seed, cfg, phase, self.version, t.sim)


def run_digest(cfg: C.RunConfig, version: str, sim: dict | None = None) -> str:
    """Names a run folder by what made it: the config (out aside), the code version, the hashes
    of the user's own files (psgd/train/workload.py `sources`) and, for a simulated run, its time model's settings."""
    from psgd.train import workload  # noqa: PLC0415 - hashes the user's files, imports nothing of theirs

    d = C.to_dict(dataclasses.replace(cfg, out=""))
    # The user's own model / data / loss: their files' hashes too, so an edited file is a new run.
    found = workload.sources(cfg)
    key = [d, version, {k: v["sha256"] for k, v in found.items()}] if found else [d, version]
    if sim:
        key.append({"simulate": sim})  # never the folder of the real run of the same config
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


# -- tuning -------------------------------------------------------------------------------------------
def score(summary_dir: str, last_k: int, metric: str = "val_accuracy") -> float:
    """A finished run's tuning score, higher is better: the mean validation accuracy of its last k
    evaluations, or with `metric` "val_loss" minus their mean validation loss (a language model's
    figure of merit is its loss: next-character accuracy can rank rates that the loss ranks the
    other way). nan if it diverged."""
    vals = [e[metric] for e in read_events(Path(summary_dir) / "metrics.jsonl")
            if e.get("event") == "eval" and "version" in e and e.get(metric) is not None]
    tail = vals[-last_k:]
    if not tail or not all(math.isfinite(v) for v in tail):
        return float("nan")
    mean = sum(tail) / len(tail)
    return -mean if metric == "val_loss" else mean


def choose(exp: Experiment, scores: dict[tuple[str, float], list[float]]) -> dict[str, float]:
    """The best rate per tuned label: highest mean score over tuning seeds; ties go to the smaller rate.
    A rate whose every tuning seed diverged (no finite score) ranks below every other: -inf, not a
    number a score can fall under (a loss's score is minus the loss, -2.7 say, which ranked below
    the -1.0 that stood for "diverged", so E17's plain-SGD control chose a rate that diverged)."""
    chosen = {}
    for t in exp.templates:
        if t.lr_grid:
            def key(lr: float, t: RunTemplate = t) -> tuple[float, float]:
                v = [x for x in scores.get((t.label, lr), []) if x == x]
                return (sum(v) / len(v) if v else -math.inf, -lr)
            chosen[t.label] = max(t.lr_grid, key=key)
    return chosen
