"""Reading suite and experiment files: TOML -> checked `Experiment`s (no process, no I/O but reading).

Contract (the schema itself: psgd/lab/experiment.py):
- `load_experiment(path, profile, results, version, suite_base, suite_overrides)`: one experiment
  file under the suite file's [base] and profile table (the experiment's own tables win), grids
  expanded, the [tune] table checked (at least 3 tuning seeds), the [margin] table read
  (psgd/lab/verdict_checks.py), every config built (and so validated) now, not halfway
  through a suite.
- `load_suite(path, profile, only, results, version)`: the experiment files a suite names
  (`suite_files`: a plain entry names one file; a pattern takes every matching file of this suite).
- Every refusal is one line, a SuiteError naming the file and the key (psgd/lab/settings.py).
"""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path

from psgd.core import config as C
from psgd.lab.experiment import PROFILES, SCORINGS, TUNE_METRICS, TUNE_MIN_SEEDS, Experiment, RunTemplate
from psgd.lab.settings import PROFILE_KEYS, RUN_KEYS, SuiteError, check_table, known_keys, sim_settings

__all__ = ["EXPERIMENT_KEYS", "TUNE_KEYS", "read_toml", "load_experiment", "suite_files", "load_suite"]

EXPERIMENT_KEYS = {"id", "title", "claim", "quote", "quote_en", "quote_source", "analysis", "why", "seeds", "base",
                   "runs", "profiles", "params", "bench", "bench_args", "tune", "margin_why", "scoring", "suite",
                   "by_construction", "margin"}
TUNE_KEYS = {"lr", "seeds", "last_k", "metric"}


def read_toml(path: Path) -> dict:
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
    return RunTemplate(label, settings, lr_grid, str(lr_from), float(factor), eval_samples, sim_settings(meta, where))


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
    doc = read_toml(path)
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
        taken = [f for f in sorted(path.parent.glob(entry))
                 if f != path and read_toml(f).get("suite", "default") == name]
        if not taken:
            raise SuiteError(f"{path}: pattern {entry!r} matches no experiment file of suite {name!r} in "
                             f"{path.parent} (a file joins a suite by its `suite` key; none: \"default\")")
        files += [f for f in taken if f not in files]
    return files


def load_suite(path: Path, profile: str = "default", only: set[str] | None = None,
               results: Path = Path("results"), version: str = "") -> list[Experiment]:
    doc = read_toml(path)
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
