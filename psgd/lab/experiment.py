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
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from psgd.core import config as C
from psgd.train.metrics import read_events, samples_per_update

EXPERIMENT_KEYS = {"id", "title", "claim", "quote", "quote_en", "quote_source", "analysis", "why", "seeds", "base",
                   "runs", "profiles", "params", "bench", "bench_args", "tune", "margin_why", "scoring", "suite",
                   "by_construction", "margin"}
RUN_KEYS = {"label", "lr_from", "lr_factor", "tune_lr", "tune", "eval_samples"}  # besides RunConfig fields
TUNE_KEYS = {"lr", "seeds", "last_k", "metric"}
TUNE_MIN_SEEDS = 3   # tuning scores the mean over at least this many seeds (psgd/lab/tuning.py)
TUNE_METRICS = ("val_accuracy", "val_loss")  # what tuning scores (higher accuracy, or lower loss, wins)
PROFILES = ("default", "quick", "full", "reference")
# How a run's final figure is read (results.py): "end", the mean of its last evaluations (the budget's
# end); "best_val", the test figure at its evaluation of best validation metric (early stopping).
SCORINGS = ("end", "best_val")


class SuiteError(ValueError):
    """A bad suite or experiment file; the message names the file and the key."""


@dataclass(frozen=True)
class RunSpec:
    experiment: str
    label: str
    seed: int
    cfg: C.RunConfig
    phase: str = "final"          # final | tune (a point of a learning-rate sweep)
    version: str = ""             # code version that must have made a reusable result

    @property
    def command(self) -> str:
        return "psgd run " + shlex.join(C.to_argv(self.cfg))


@dataclass(frozen=True)
class RunTemplate:
    """One [[runs]] entry after grid expansion: settings without seed and out, and how its lr is set."""
    label: str
    settings: dict
    lr_grid: tuple[float, ...] = ()   # tuned over this grid (empty: not tuned)
    lr_from: str = ""                 # or: the chosen rate of another label ...
    lr_factor: float = 1.0            # ... times this
    eval_samples: int = 0


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
        cfg = dataclasses.replace(cfg, out=str(self.results / "runs" / run_digest(cfg, self.version)))
        return RunSpec(self.id, t.label, seed, cfg, phase, self.version)


def run_digest(cfg: C.RunConfig, version: str) -> str:
    """Names a run folder by what made it: the config (out aside), the code version and the hashes
    of the user's own files (psgd/train/workload.py `sources`)."""
    from psgd.train import workload  # noqa: PLC0415 - hashes the user's files, imports nothing of theirs

    d = C.to_dict(dataclasses.replace(cfg, out=""))
    # The user's own model / data / loss: their files' hashes too, so an edited file is a new run.
    found = workload.sources(cfg)
    key = [d, version, {k: v["sha256"] for k, v in found.items()}] if found else [d, version]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


# -- settings: flat TOML keys <-> the nested RunConfig (the schema: psgd/core/config.py) -------------
def known_keys() -> dict[str, tuple[str, object]]:
    """Flat key -> (section, type): RunConfig's leaf fields, "" for its own, else "data" | "model" | "optim"."""
    return {leaf.name: (leaf.section, leaf.type) for leaf in C.leaves()}


def _coerce(key: str, typ: object, value, where: str):
    def bad(expected: str) -> SuiteError:
        return SuiteError(f"{where}: key {key!r} must be {expected}, got {value!r}")

    if typ is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if typ == C.Pairs:
        if not isinstance(value, list):
            raise bad('a list like ["0=40"]')
        pairs = []
        for item in value:
            m = re.fullmatch(r"\s*(\d+)\s*=\s*(\d+)\s*", item) if isinstance(item, str) else None
            if not m:
                raise bad('a list like ["0=40"]')
            pairs.append((int(m[1]), int(m[2])))
        return tuple(pairs)
    raise bad(f"a value of type {typ}")


PROFILE_KEYS = {"seeds", "bench_args", "tune", "params", "runs"}  # a profile's own keys, besides settings


def check_table(table: object, where: str, skip: frozenset[str] | set[str] = frozenset()) -> dict:
    """A [base] or [profiles.X] table, checked on its own before it is merged anywhere: every key is
    a run setting (or a run key such as eval_samples) and every value has the setting's type, so a
    typo is reported in the table that has it, and also when another profile would override it."""
    if not isinstance(table, dict):
        raise SuiteError(f"{where}: must be a table")
    keys = known_keys()
    for key, value in table.items():
        if key in RUN_KEYS - {"label"} or key in skip:
            continue  # checked where they are used (a run's keys, a profile's seeds / tune / runs ...)
        if key not in keys:
            raise SuiteError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(keys))})")
        _coerce(key, keys[key][1], value, where)
    return table


def config_from_settings(settings: dict, where: str) -> C.RunConfig:
    """Build and validate a RunConfig from flat settings; SuiteError names the bad key."""
    keys = known_keys()
    flat = {}
    for key, value in settings.items():
        if key not in keys:
            raise SuiteError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(keys))})")
        flat[key] = _coerce(key, keys[key][1], value, where)
    try:
        return C.validate(C.from_flat(flat))
    except ValueError as e:
        raise SuiteError(f"{where}: {e}") from None


# -- loading ------------------------------------------------------------------------------------------
def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise SuiteError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(f"{path}: not valid TOML: {e}") from None


def _expand(run: dict, where: str) -> list[dict]:
    """A run whose scalar settings are lists is a grid: one run per combination (label formatted)."""
    keys = known_keys()
    axes = [k for k, v in run.items() if isinstance(v, list) and k in keys and keys[k][1] != C.Pairs]
    if not axes:
        return [run]
    out = []
    for values in itertools.product(*(run[k] for k in axes)):
        r = dict(run, **dict(zip(axes, values, strict=True)))
        try:
            r["label"] = str(run.get("label", "")).format(**{k: r[k] for k in keys if k in r})
        except (KeyError, IndexError, ValueError) as e:
            raise SuiteError(f"{where}: label {run.get('label')!r} of a grid cannot be formatted: {e}") from None
        out.append(r)
    return out


def _number_list(value, key: str, where: str, kind: type = float) -> tuple:
    ok = isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    for v in value)
    if not ok or (kind is int and not all(isinstance(v, int) for v in value)):
        raise SuiteError(f"{where}: key {key!r} must be a non-empty list of {'integers' if kind is int else 'numbers'}")
    return tuple(kind(v) for v in value)


def _check_header(doc: dict, path: Path) -> None:
    """Check an experiment file's top-level keys, its strings and its profiles' names; SuiteError names the key."""
    unknown = set(doc) - EXPERIMENT_KEYS
    if unknown:
        raise SuiteError(f"{path}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(EXPERIMENT_KEYS))})")
    for key in ("id", "title", "claim", "analysis"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise SuiteError(f"{path}: key {key!r} is required (a string)")
    for key in ("quote", "quote_en", "quote_source", "margin_why", "by_construction"):
        if not isinstance(doc.get(key, ""), str):
            raise SuiteError(f"{path}: key {key!r} must be a string")
    scoring = doc.get("scoring", SCORINGS[0])
    if scoring not in SCORINGS:
        raise SuiteError(f"{path}: key 'scoring' must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    if doc.get("quote_en") and not doc.get("quote"):
        raise SuiteError(f"{path}: key 'quote_en' translates 'quote', which is missing")
    if doc.get("quote_source") and not doc.get("quote"):
        raise SuiteError(f"{path}: key 'quote_source' says where 'quote' is from, which is missing")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", doc["id"]):
        raise SuiteError(f"{path}: key 'id' must be letters, digits, - or _, got {doc['id']!r}")
    profiles = doc.get("profiles", {})
    if not isinstance(profiles, dict) or set(profiles) - set(PROFILES):
        raise SuiteError(f"{path}: key 'profiles' may only have tables {', '.join(PROFILES[1:])}")


def _margins(table: object, path: Path) -> dict:
    """The file's `[margin]` table (psgd/lab/verdict_checks.py): top level only, so no profile moves it."""
    from psgd.lab.verdict_checks import parse_margins  # noqa: PLC0415 - the lab's checks, not a loading concern

    try:
        return parse_margins(table, str(path))
    except ValueError as e:
        raise SuiteError(str(e)) from None


def _bench_argv(args: dict, folder: Path) -> tuple[str, ...]:
    """A benchmark's [bench_args] as flags: true = a bare flag, false = none, a list = comma-joined."""
    argv = []
    for k, v in args.items():
        flag = f"--{k.replace('_', '-')}"
        if v is True:
            argv.append(flag)
        elif v is not False:
            text = ",".join(map(str, v)) if isinstance(v, list) else str(v)
            argv += [flag, text.replace("{out}", str(folder))]  # "{out}": the experiment's folder
    return tuple(argv)


def _tune_settings(tune: dict, path: Path) -> tuple[tuple[float, ...], tuple[int, ...], int, str]:
    """The merged [tune] table checked: (lr grid, tuning seeds, last_k, metric), defaults filled in."""
    if set(tune) - TUNE_KEYS:
        raise SuiteError(f"{path}: unknown key {sorted(set(tune) - TUNE_KEYS)[0]!r} in [tune] "
                         f"(known: {', '.join(sorted(TUNE_KEYS))})")
    grid = _number_list(tune["lr"], "tune.lr", str(path)) if "lr" in tune else ()
    tune_seeds = _number_list(tune.get("seeds", [100, 101, 102]), "tune.seeds", str(path), int)
    if len(set(tune_seeds)) < TUNE_MIN_SEEDS:
        raise SuiteError(f"{path}: key 'tune.seeds' needs at least {TUNE_MIN_SEEDS} different seeds (a rate is "
                         f"chosen on the mean validation result over seeds), got {list(tune_seeds)}")
    last_k = tune.get("last_k", 3)
    if not isinstance(last_k, int) or last_k < 1:
        raise SuiteError(f"{path}: key 'tune.last_k' must be an integer >= 1")
    metric = tune.get("metric", TUNE_METRICS[0])
    if metric not in TUNE_METRICS:
        raise SuiteError(f"{path}: key 'tune.metric' must be one of {', '.join(TUNE_METRICS)}, got {metric!r}")
    return grid, tune_seeds, last_k, metric


def _template(label: str, run: dict, base: dict, overrides: dict, grid: tuple[float, ...],
              where: str) -> RunTemplate:
    """One expanded run (its label popped) as a RunTemplate: its settings and how its lr is set."""
    # A profile's overrides win over base and run settings: --quick must be quick everywhere.
    settings = {**base, **run, **overrides}
    meta = {k: settings.pop(k) for k in RUN_KEYS - {"label"} if k in settings}
    lr_grid: tuple[float, ...] = ()
    if "tune_lr" in meta:
        lr_grid = _number_list(meta["tune_lr"], "tune_lr", where)
    elif grid and "lr" not in {**run} and "lr_from" not in meta and meta.get("tune", True):
        lr_grid = grid
    if lr_grid and not settings.get("val_fraction"):
        raise SuiteError(f"{where}: tuning needs a validation split: set val_fraction (e.g. 0.2) in [base]")
    lr_from = meta.get("lr_from", "")
    factor = meta.get("lr_factor", 1.0)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise SuiteError(f"{where}: key 'lr_factor' must be a positive number")
    eval_samples = meta.get("eval_samples", 0)
    if not isinstance(eval_samples, int) or isinstance(eval_samples, bool) or eval_samples < 0:
        raise SuiteError(f"{where}: key 'eval_samples' must be an integer >= 0")
    return RunTemplate(label, settings, lr_grid, str(lr_from), float(factor), eval_samples)


def _templates(runs_doc: list, base: dict, overrides: dict, grid: tuple[float, ...],
               path: Path) -> list[RunTemplate]:
    """Every [[runs]] entry, grids expanded, as RunTemplates; each needs a label of its own."""
    templates, labels = [], set()
    for i, raw in enumerate(runs_doc):
        for run in _expand(dict(raw), f"{path} [[runs]] #{i + 1}"):
            label = run.pop("label", None)
            if not isinstance(label, str) or not label:
                raise SuiteError(f"{path}: [[runs]] #{i + 1} needs a 'label'")
            if label in labels:
                raise SuiteError(f"{path}: [[runs]] label {label!r} is used twice")
            labels.add(label)
            templates.append(_template(label, run, base, overrides, grid, f"{path} [[runs]] {label!r}"))
    return templates


def _check_templates(templates: list[RunTemplate], scoring: str, path: Path) -> None:
    """Checks across runs: best_val scoring needs every run's validation split, lr_from a tuned label."""
    if scoring == "best_val":
        lacking = [t.label for t in templates if not t.settings.get("val_fraction")]
        if lacking:
            raise SuiteError(f"{path}: scoring = \"best_val\" reads each run's validation metric per evaluation, "
                             f"but run {lacking[0]!r} has no validation split: set val_fraction (e.g. 0.2)")
    by_label = {t.label: t for t in templates}
    for t in templates:
        if t.lr_from and (t.lr_from not in by_label or not by_label[t.lr_from].lr_grid):
            raise SuiteError(f"{path} [[runs]] {t.label!r}: lr_from names {t.lr_from!r}, which is not a tuned run")


def load_experiment(path: Path, profile: str, results: Path, version: str = "",
                    suite_base: dict | None = None, suite_overrides: dict | None = None) -> Experiment:
    """One experiment file; `suite_base` / `suite_overrides` are the suite file's [base] and its
    profile's table, under the experiment's own (so experiments that share settings share runs)."""
    doc = _read_toml(path)
    _check_header(doc, path)
    scoring, exp_id, profiles = doc.get("scoring", SCORINGS[0]), doc["id"], doc.get("profiles", {})
    overrides = dict(profiles.get(profile, {})) if profile != "default" else {}
    seeds = overrides.pop("seeds", doc.get("seeds", [0]))
    bench_override = overrides.pop("bench_args", {})
    tune = {**doc.get("tune", {}), **overrides.pop("tune", {})}
    params = {**doc.get("params", {}), **overrides.pop("params", {})}
    extra_runs = overrides.pop("runs", [])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise SuiteError(f"{path}: key 'seeds' must be a non-empty list of integers")
    common = dict(id=exp_id, title=doc["title"], claim=doc["claim"], quote=doc.get("quote", ""),
                  quote_en=" ".join(str(doc.get("quote_en", "")).split()),
                  quote_source=" ".join(str(doc.get("quote_source", "")).split()),
                  why=" ".join(str(doc.get("why", "")).split()), analysis=doc["analysis"], path=path,
                  margin_why=" ".join(str(doc.get("margin_why", "")).split()), scoring=scoring,
                  by_construction=" ".join(str(doc.get("by_construction", "")).split()),
                  params=params, results=results, version=version, seeds=tuple(seeds),
                  margins=_margins(doc.get("margin", {}), path))
    if "bench" in doc:
        argv = _bench_argv({**doc.get("bench_args", {}), **bench_override}, results / exp_id)
        if scoring != "end":
            raise SuiteError(f"{path}: key 'scoring' is for learning runs; a benchmark has no validation split")
        return Experiment(**common, bench=str(doc["bench"]), bench_args=argv)
    runs_doc = list(doc.get("runs") or []) + list(extra_runs)
    if not runs_doc:
        raise SuiteError(f"{path}: needs at least one [[runs]] table (or bench = ...)")
    grid, tune_seeds, last_k, metric = _tune_settings(tune, path)
    for name, table in profiles.items():
        check_table(table, f"{path} [profiles.{name}]", PROFILE_KEYS)
    base = {**(suite_base or {}), **check_table(doc.get("base", {}), f"{path} [base]")}
    templates = _templates(runs_doc, base, {**(suite_overrides or {}), **overrides}, grid, path)
    _check_templates(templates, scoring, path)
    exp = Experiment(**common, templates=tuple(templates), tune_seeds=tune_seeds, tune_last_k=last_k,
                     tune_metric=metric)
    # Build (and so validate) every config now, not halfway through the suite.
    exp.tune_specs()
    exp.planned_specs()
    return exp


def suite_files(path: Path, name: str, entries: list[str]) -> list[Path]:
    """The experiment files a suite lists: a plain entry names one file; a pattern (`e*.toml`) takes,
    in name order, every matching file whose `suite` key names this suite (no key: "default"), so
    that a new claim is its own experiment file and analysis module, with no list to edit."""
    files: list[Path] = []
    for entry in entries:
        if not any(c in entry for c in "*?["):
            files.append(path.parent / entry)
            continue
        for f in sorted(path.parent.glob(entry)):
            if f != path and _read_toml(f).get("suite", "default") == name and f not in files:
                files.append(f)
    return files


def load_suite(path: Path, profile: str = "default", only: set[str] | None = None,
               results: Path = Path("results"), version: str = "") -> list[Experiment]:
    doc = _read_toml(path)
    names = doc.get("suite", {}).get("experiments")
    if not isinstance(names, list) or not names:
        raise SuiteError(f"{path}: needs [suite] experiments = [\"file.toml\", ...]")
    suite_profiles = doc.get("profiles", {})
    if not isinstance(suite_profiles, dict) or set(suite_profiles) - set(PROFILES):
        raise SuiteError(f"{path}: key 'profiles' may only have tables {', '.join(PROFILES[1:])}")
    suite_base = check_table(doc.get("base", {}), f"{path} [base]")
    for name, table in suite_profiles.items():
        check_table(table, f"{path} [profiles.{name}]", PROFILE_KEYS)
    suite_overrides = dict(suite_profiles.get(profile, {})) if profile != "default" else {}
    experiments = [load_experiment(f, profile, results, version, suite_base, suite_overrides)
                   for f in suite_files(path, doc["suite"].get("name", "default"), names)]
    ids = [e.id for e in experiments]
    if len(set(ids)) != len(ids):
        raise SuiteError(f"{path}: experiment ids repeat: {ids}")
    if only:
        missing = only - set(ids)
        if missing:
            raise SuiteError(f"--only names unknown experiments {sorted(missing)}; the suite has {', '.join(ids)}")
    return experiments


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
    """The best rate per tuned label: highest mean score over tuning seeds; ties go to the smaller rate."""
    chosen = {}
    for t in exp.templates:
        if t.lr_grid:
            def key(lr: float, t: RunTemplate = t) -> tuple[float, float]:
                v = [x for x in scores.get((t.label, lr), []) if x == x]
                return (sum(v) / len(v) if v else -1.0, -lr)
            chosen[t.label] = max(t.lr_grid, key=key)
    return chosen
