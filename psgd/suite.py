"""`psgd suite FILE.toml`: tune, run every experiment of a suite, then write figures, CSVs and REPORT.md.

Contract:
- A suite file names experiment files (`[suite] experiments = [...]`, relative to it) and may
  hold a `[base]` and `[profiles.quick]` / `[profiles.full]` of settings shared by every learning
  experiment (an experiment's own tables win; bench experiments ignore them). An
  experiment file is one claim: `id`, `title`, `claim`, `quote` (the seed article's words),
  `analysis` (which analysis in psgd/analyses.py reads its runs), `why` (why these models, data
  and budgets make the effect visible), `seeds`, a `[base]` table of run settings, `[[runs]]`
  (each a `label` plus settings that override base), optional `[params]` for the analysis,
  `[tune]`, and `[profiles.quick]` / `[profiles.full]` overrides of base (and of `seeds`, `tune`,
  `params`; `runs` in a profile are added). A benchmark experiment has `bench = "NAME"` and
  `[bench_args]` (flags; true = a bare flag, "{out}" = the experiment's results folder) instead
  of runs; what the benchmark prints is kept as `RESULTS/<id>/bench.json` or `bench.txt`.
  Settings are RunConfig field names (`workers`, `lr`, `straggler = ["0=40"]`, ...); a bad key
  or value is a one-line error naming the file and the key. A list where a single value is
  expected makes a grid: `workers = [1, 4]` and `lr = [0.1, 1.0]` give four runs, and the label
  is a format string (`label = "async N={workers} lr={lr}"`).
- `eval_samples` (in base or a run) puts every run on one grid of training samples: the suite
  sets each run's `--eval-every` to eval_samples / (samples per update of that run), so sync,
  async and local SGD are all evaluated after the same numbers of samples.
- Learning rates are tuned, never guessed per mode: with `[tune] lr = [...]`, every run without
  an explicit `lr` is first run at each rate of the grid (seeds `[tune] seeds`, kept apart from
  the evaluation seeds) and scored on the validation split (`val_fraction`, carved from the
  training set); the rate with the best mean of the last `last_k` validation accuracies is
  chosen (ties: the smaller rate). A run may name its own grid (`tune_lr = [...]`), take another
  label's chosen rate (`lr_from = "sync"`, optionally times `lr_factor`), or opt out (`tune = false`).
  The test set is never looked at while choosing.
- Runs go to `RESULTS/runs/<digest>/`, the digest of their config and the code version
  (psgd/provenance.py): identical runs of different experiments are made once, and a run made by
  other code is never reused. A finished run (summary.json, matching config.json and
  provenance.json) is reused unless `--fresh`. Each experiment writes `RESULTS/<id>/` (PNG, CSV,
  `commands.txt` with the exact commands, tuning ones included) and the suite writes
  `RESULTS/REPORT.md` and `RESULTS/summary.json` (verdicts, key numbers, code version, wall time).

    psgd suite experiments/default.toml              # what `make experiments` runs
    psgd suite experiments/default.toml --only E2,E3   # rerun two; the report still covers all
    psgd suite experiments/default.toml --full --results results/full
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import re
import shlex
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from psgd import config as C
from psgd.metrics import samples_per_update
from psgd.provenance import code_version

EXPERIMENT_KEYS = {"id", "title", "claim", "quote", "analysis", "why", "seeds", "base", "runs", "profiles",
                   "params", "bench", "bench_args", "tune"}
RUN_KEYS = {"label", "lr_from", "lr_factor", "tune_lr", "tune", "eval_samples"}  # besides RunConfig fields
TUNE_KEYS = {"lr", "seeds", "last_k"}
PROFILES = ("default", "quick", "full")


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
    tune_seeds: tuple[int, ...] = (100,)
    tune_last_k: int = 3
    results: Path = Path("results")
    version: str = ""
    bench: str = ""
    bench_args: tuple[str, ...] = ()
    params: dict = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return self.id

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
        if t.eval_samples:
            per = samples_per_update(cfg)
            if t.eval_samples % per:
                raise SuiteError(f"{where}: eval_samples {t.eval_samples} is not a multiple of the {per} samples "
                                 f"of one update")
            cfg = dataclasses.replace(cfg, eval_every=t.eval_samples // per)
        cfg = dataclasses.replace(cfg, out=str(self.results / "runs" / run_digest(cfg, self.version)))
        return RunSpec(self.id, t.label, seed, cfg, phase, self.version)


def run_digest(cfg: C.RunConfig, version: str) -> str:
    """Names a run folder by what made it: the config (out aside) and the code version."""
    d = C.to_dict(dataclasses.replace(cfg, out=""))
    return hashlib.sha256(json.dumps([d, version], sort_keys=True).encode()).hexdigest()[:16]


# -- settings: flat TOML keys <-> the nested RunConfig ------------------------------------------
def _sections() -> dict[str, object]:
    return {"": C.RunConfig, "data": C.DataConfig, "model": C.ModelConfig, "optim": C.OptimConfig}


def known_keys() -> dict[str, tuple[str, str]]:
    """Flat key -> (section, type as written in the dataclass)."""
    keys = {}
    for section, klass in _sections().items():
        for f in dataclasses.fields(klass):
            if not (section == "" and f.name in ("data", "model", "optim")):  # the nested sections
                keys[f.name] = (section, str(f.type))
    return keys


def _coerce(key: str, typ: str, value, where: str):
    def bad(expected: str) -> SuiteError:
        return SuiteError(f"{where}: key {key!r} must be {expected}, got {value!r}")

    if typ == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if typ == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if typ == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if typ == "str":
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if typ.startswith("tuple[tuple[int, int]"):
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


def config_from_settings(settings: dict, where: str) -> C.RunConfig:
    """Build and validate a RunConfig from flat settings; SuiteError names the bad key."""
    keys = known_keys()
    nested: dict[str, dict] = {s: {} for s in _sections()}
    for key, value in settings.items():
        if key not in keys:
            raise SuiteError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(keys))})")
        section, typ = keys[key]
        nested[section][key] = _coerce(key, typ, value, where)
    top = nested.pop("")
    cfg = C.RunConfig(**top, data=C.DataConfig(**nested["data"]), model=C.ModelConfig(**nested["model"]),
                      optim=C.OptimConfig(**nested["optim"]))
    try:
        return C.validate(cfg)
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
    axes = [k for k, v in run.items() if isinstance(v, list) and k in keys and not keys[k][1].startswith("tuple")]
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


def load_experiment(path: Path, profile: str, results: Path, version: str = "",
                    suite_base: dict | None = None, suite_overrides: dict | None = None) -> Experiment:
    """One experiment file; `suite_base` / `suite_overrides` are the suite file's [base] and its
    profile's table, under the experiment's own (so experiments that share settings share runs)."""
    doc = _read_toml(path)
    unknown = set(doc) - EXPERIMENT_KEYS
    if unknown:
        raise SuiteError(f"{path}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(EXPERIMENT_KEYS))})")
    for key in ("id", "title", "claim", "analysis"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise SuiteError(f"{path}: key {key!r} is required (a string)")
    exp_id = doc["id"]
    if not re.fullmatch(r"[A-Za-z0-9_-]+", exp_id):
        raise SuiteError(f"{path}: key 'id' must be letters, digits, - or _, got {exp_id!r}")
    profiles = doc.get("profiles", {})
    if not isinstance(profiles, dict) or set(profiles) - set(PROFILES):
        raise SuiteError(f"{path}: key 'profiles' may only have tables {', '.join(PROFILES[1:])}")
    overrides = dict(profiles.get(profile, {})) if profile != "default" else {}
    seeds = overrides.pop("seeds", doc.get("seeds", [0]))
    bench_override = overrides.pop("bench_args", {})
    tune = {**doc.get("tune", {}), **overrides.pop("tune", {})}
    params = {**doc.get("params", {}), **overrides.pop("params", {})}
    extra_runs = overrides.pop("runs", [])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise SuiteError(f"{path}: key 'seeds' must be a non-empty list of integers")
    common = dict(id=exp_id, title=doc["title"], claim=doc["claim"], quote=doc.get("quote", ""),
                  why=" ".join(str(doc.get("why", "")).split()), analysis=doc["analysis"], path=path,
                  params=params, results=results, version=version, seeds=tuple(seeds))
    if "bench" in doc:
        args = {**doc.get("bench_args", {}), **bench_override}
        argv = []
        for k, v in args.items():
            flag = f"--{k.replace('_', '-')}"
            if v is True:
                argv.append(flag)
            elif v is not False:
                text = ",".join(map(str, v)) if isinstance(v, list) else str(v)
                argv += [flag, text.replace("{out}", str(results / exp_id))]  # "{out}": the experiment's folder
        return Experiment(**common, bench=str(doc["bench"]), bench_args=tuple(argv))
    runs_doc = list(doc.get("runs") or []) + list(extra_runs)
    if not runs_doc:
        raise SuiteError(f"{path}: needs at least one [[runs]] table (or bench = ...)")
    if set(tune) - TUNE_KEYS:
        raise SuiteError(f"{path}: unknown key {sorted(set(tune) - TUNE_KEYS)[0]!r} in [tune] "
                         f"(known: {', '.join(sorted(TUNE_KEYS))})")
    grid = _number_list(tune["lr"], "tune.lr", str(path)) if "lr" in tune else ()
    tune_seeds = _number_list(tune.get("seeds", [100]), "tune.seeds", str(path), int)
    last_k = tune.get("last_k", 3)
    if not isinstance(last_k, int) or last_k < 1:
        raise SuiteError(f"{path}: key 'tune.last_k' must be an integer >= 1")
    base = {**(suite_base or {}), **doc.get("base", {})}
    overrides = {**(suite_overrides or {}), **overrides}
    templates, labels = [], set()
    for i, raw in enumerate(runs_doc):
        for run in _expand(dict(raw), f"{path} [[runs]] #{i + 1}"):
            label = run.pop("label", None)
            if not isinstance(label, str) or not label:
                raise SuiteError(f"{path}: [[runs]] #{i + 1} needs a 'label'")
            if label in labels:
                raise SuiteError(f"{path}: [[runs]] label {label!r} is used twice")
            labels.add(label)
            where = f"{path} [[runs]] {label!r}"
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
            templates.append(RunTemplate(label, settings, lr_grid, str(lr_from), float(factor), eval_samples))
    by_label = {t.label: t for t in templates}
    for t in templates:
        if t.lr_from and (t.lr_from not in by_label or not by_label[t.lr_from].lr_grid):
            raise SuiteError(f"{path} [[runs]] {t.label!r}: lr_from names {t.lr_from!r}, which is not a tuned run")
    exp = Experiment(**common, templates=tuple(templates), tune_seeds=tune_seeds, tune_last_k=last_k)
    # Build (and so validate) every config now, not halfway through the suite.
    exp.tune_specs()
    exp.final_specs({t.label: t.lr_grid[0] for t in templates if t.lr_grid})
    return exp


def load_suite(path: Path, profile: str = "default", only: set[str] | None = None,
               results: Path = Path("results"), version: str = "") -> list[Experiment]:
    doc = _read_toml(path)
    names = doc.get("suite", {}).get("experiments")
    if not isinstance(names, list) or not names:
        raise SuiteError(f"{path}: needs [suite] experiments = [\"file.toml\", ...]")
    suite_profiles = doc.get("profiles", {})
    if not isinstance(suite_profiles, dict) or set(suite_profiles) - set(PROFILES):
        raise SuiteError(f"{path}: key 'profiles' may only have tables {', '.join(PROFILES[1:])}")
    suite_base = doc.get("base", {})
    suite_overrides = dict(suite_profiles.get(profile, {})) if profile != "default" else {}
    experiments = [load_experiment(path.parent / n, profile, results, version, suite_base, suite_overrides)
                   for n in names]
    ids = [e.id for e in experiments]
    if len(set(ids)) != len(ids):
        raise SuiteError(f"{path}: experiment ids repeat: {ids}")
    if only:
        missing = only - set(ids)
        if missing:
            raise SuiteError(f"--only names unknown experiments {sorted(missing)}; the suite has {', '.join(ids)}")
    return experiments


# -- tuning -------------------------------------------------------------------------------------------
def score(summary_dir: str, last_k: int) -> float:
    """Mean validation accuracy of the last k evaluations of a finished run (nan if diverged)."""
    from psgd.metrics import read_events

    vals = [e["val_accuracy"] for e in read_events(Path(summary_dir) / "metrics.jsonl")
            if e.get("event") == "eval" and "version" in e and e.get("val_accuracy") is not None]
    tail = vals[-last_k:]
    return sum(tail) / len(tail) if tail else float("nan")


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


def tuning_of(exp: Experiment) -> tuple[dict[str, float], dict[tuple[str, float], list[float]]]:
    """(chosen rate per label, scores) from the finished tuning runs."""
    scores: dict[tuple[str, float], list[float]] = {}
    for spec in exp.tune_specs():
        scores.setdefault((spec.label, spec.cfg.optim.lr), []).append(score(spec.cfg.out, exp.tune_last_k))
    return choose(exp, scores), scores


# -- running --------------------------------------------------------------------------------------------
SECONDS_PER_RUN_START = 5.0   # process start-up + evaluation of one `psgd run` on 2 cores (measured)
SAMPLES_PER_S = 20000         # small models over --transport tcp, 4 workers (measured; only for the ETA)


def estimate_s(experiments: list[Experiment]) -> float:
    from psgd import data

    total, seen = 0.0, set()
    for e in experiments:
        if e.bench:
            total += 60.0
        specs = e.tune_specs() + e.final_specs({t.label: t.lr_grid[0] for t in e.templates if t.lr_grid})
        for r in specs:
            if r.cfg.out in seen or is_cached(r):
                continue
            seen.add(r.cfg.out)
            cfg = C.with_epochs_resolved(r.cfg, data.train_size(r.cfg.data))
            total += SECONDS_PER_RUN_START + cfg.steps * cfg.global_batch / SAMPLES_PER_S
    return total


def is_cached(spec: RunSpec) -> bool:
    out = Path(spec.cfg.out)
    try:
        recorded = json.loads((out / "config.json").read_text())
        made_by = json.loads((out / "provenance.json").read_text())
        # Compare through JSON: tuples in the dataclass are lists in the file.
        return ((out / "summary.json").exists() and recorded == json.loads(json.dumps(C.to_dict(spec.cfg)))
                and made_by.get("code_version") == spec.version)
    except (OSError, ValueError):
        return False
def _watch_progress(spec: RunSpec, bar: tqdm, stop: threading.Event) -> None:
    """Advance `bar` with the worker steps logged to metrics.jsonl (a reader; never blocks the run)."""
    path, offset, done = Path(spec.cfg.out) / "metrics.jsonl", 0, 0
    while not stop.wait(0.5):
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            continue
        cut = chunk.rfind(b"\n") + 1
        offset += cut
        steps = chunk[:cut].count(b'"event":"step"')
        if steps:
            done += steps
            bar.update(steps)


def execute(spec: RunSpec, fresh: bool, position: str) -> dict:
    """Run one spec (or reuse its cached result); returns its summary."""
    from psgd import data, launch

    if not fresh and is_cached(spec):
        tqdm.write(f"{position} {spec.experiment} {spec.label} seed {spec.seed}: cached", file=sys.stderr)
        return json.loads((Path(spec.cfg.out) / "summary.json").read_text())
    cfg = C.with_epochs_resolved(spec.cfg, data.train_size(spec.cfg.data))
    tag = f"{position} {spec.experiment} {spec.label}" + (f" lr={spec.cfg.optim.lr:g}" if spec.phase == "tune" else "")
    bar = tqdm(total=cfg.budget, desc=f"{tag} s{spec.seed}", unit="grad", leave=False, dynamic_ncols=True,
               file=sys.stderr)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_progress, args=(spec, bar, stop), daemon=True)
    watcher.start()
    try:
        summary = launch.run(cfg)
    finally:
        stop.set()
        watcher.join()
        bar.close()
    # Record the config as specified (before --epochs was resolved), so the cache check matches.
    out = Path(cfg.out)
    (out / "config.json").write_text(json.dumps(C.to_dict(spec.cfg), indent=1))
    (out / "provenance.json").write_text(json.dumps({"code_version": spec.version, "command": spec.command,
                                                     "made_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                                                    indent=1))
    return summary


def _has_results(exp: Experiment) -> bool:
    """Whether an experiment that is not being run has finished results to analyse."""
    if exp.bench:
        return any((exp.results / exp.id / name).exists() for name in ("bench.json", "bench.txt"))
    if not all(is_cached(spec) for spec in exp.tune_specs()):
        return False
    return all(is_cached(spec) for spec in exp.final_specs(tuning_of(exp)[0]))


def _run_bench(exp: Experiment, out: Path, where: str) -> None:
    from psgd import bench

    tqdm.write(f"{where}: psgd bench {exp.bench} {shlex.join(exp.bench_args)}", file=sys.stderr)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = bench.main([exp.bench, *exp.bench_args])
    if rc:
        raise SuiteError(f"{exp.id}: psgd bench {exp.bench} exited with {rc}")
    name = "bench.json" if "--json" in exp.bench_args else "bench.txt"
    (out / name).write_text(printed.getvalue())


def _commands(exp: Experiment, tune_specs: list[RunSpec], finals: list[RunSpec], command: str) -> str:
    head = f"# made by: {command or 'psgd suite'}\n# experiment file: {exp.path}\n# code version: {exp.version}\n"
    if exp.bench:
        return head + f"psgd bench {exp.bench} {shlex.join(exp.bench_args)}\n"
    lines = []
    if tune_specs:
        lines.append("# learning-rate sweeps (scored on the validation split)")
        lines += [f"# {s.label} lr={s.cfg.optim.lr:g} seed {s.seed}\n{s.command}" for s in tune_specs]
        lines.append("# evaluated runs, at the chosen rates")
    lines += [f"# {s.label} seed {s.seed}\n{s.command}" for s in finals]
    return head + "\n".join(lines) + "\n"


def run_suite(experiments: list[Experiment], results: Path, fresh: bool = False, command: str = "",
              only: set[str] | None = None, profile: str = "default") -> Path:
    """Tune and run the experiments (all, or those in `only`), then analyse every experiment that has
    results and write the whole report; returns the REPORT.md path."""
    from psgd import analyses, report

    chosen_exps = [e for e in experiments if only is None or e.id in only]
    version = experiments[0].version if experiments else ""
    eta = estimate_s(chosen_exps)
    n_tune = len({s.cfg.out for e in chosen_exps for s in e.tune_specs()})
    n_final = len({s.cfg.out for e in chosen_exps
                   for s in e.final_specs({t.label: t.lr_grid[0] for t in e.templates if t.lr_grid})})
    benches = [e for e in chosen_exps if e.bench]
    print(f"psgd suite ({profile}, code {version}): {len(chosen_exps)} experiments, {n_tune} tuning runs, "
          f"{n_final} evaluated runs and {len(benches)} benchmarks; about {eta / 60:.0f} min on a 2-core CPU machine "
          f"(finished runs are reused; --fresh reruns them)", file=sys.stderr, flush=True)
    started = time.time()
    sections, reused, total_runs, done_outs = [], 0, 0, set()
    overall = tqdm(total=n_tune + n_final + len(benches), desc="suite", unit="run", dynamic_ncols=True,
                   file=sys.stderr)

    def run_all(specs: list[RunSpec]) -> list[tuple[RunSpec, dict]]:
        nonlocal reused, total_runs
        out = []
        for spec in specs:
            first = spec.cfg.out not in done_outs
            if first:
                reused += int(not fresh and is_cached(spec))
                total_runs += 1
            out.append((spec, execute(spec, fresh and first, f"[{overall.n + 1}/{overall.total}]")))
            if first:
                done_outs.add(spec.cfg.out)
                overall.update(1)
        return out

    for exp in experiments:
        out = results / exp.id
        if exp not in chosen_exps:
            # --only: the report still covers the whole suite, from the results already there.
            if _has_results(exp):
                chosen, scores = tuning_of(exp) if exp.tuned else ({}, {})
                finals = exp.final_specs(chosen)
                summaries = [(s, json.loads((Path(s.cfg.out) / "summary.json").read_text())) for s in finals]
                sections.append(analyses.analyse(exp, summaries, out, chosen, scores))
            else:
                tqdm.write(f"{exp.id}: not run yet, left out of the report (run the suite without --only)",
                           file=sys.stderr)
            continue
        out.mkdir(parents=True, exist_ok=True)
        tune_specs = exp.tune_specs()
        run_all(tune_specs)
        chosen, scores = tuning_of(exp) if exp.tuned else ({}, {})
        finals = exp.final_specs(chosen)
        summaries = run_all(finals)
        if exp.bench:
            _run_bench(exp, out, f"[{overall.n + 1}/{overall.total}] {exp.id}")
            overall.update(1)
        (out / "commands.txt").write_text(_commands(exp, tune_specs, finals, command))
        sections.append(analyses.analyse(exp, summaries, out, chosen, scores))
    overall.close()
    note = f"{reused} of {total_runs} runs reused from earlier invocations" if reused else ""
    path = report.write(results, sections, command=command, wall_s=time.time() - started, note=note,
                        version=version, profile=profile)
    print(f"psgd suite: wrote {path} ({(time.time() - started) / 60:.1f} min)", file=sys.stderr)
    return path


def main(argv: list[str]) -> int:
    from psgd.cli import Parser, UsageError

    p = Parser(prog="psgd suite", description="Tune and run an experiment suite; write figures, CSVs and REPORT.md.")
    p.add_argument("suite", type=Path, help="suite file, e.g. experiments/default.toml")
    p.add_argument("--only", default="", help="comma-separated experiment ids to run, e.g. E2,E3")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="smoke profile: tiny budgets, one seed")
    group.add_argument("--full", action="store_true", help="5 seeds, wider sweeps, more configurations (~2 h)")
    p.add_argument("--results", type=Path, default=None,
                   help="output folder (default results/, or results/full with --full)")
    p.add_argument("--fresh", action="store_true", help="rerun runs even when a matching result exists")
    a = p.parse_args(argv)
    profile = "quick" if a.quick else "full" if a.full else "default"
    results = a.results or (Path("results/full") if a.full else Path("results"))
    only = {s.strip() for s in a.only.split(",") if s.strip()} or None
    try:
        experiments = load_suite(a.suite, profile, only, results, code_version())
    except SuiteError as e:
        raise UsageError(str(e)) from None
    from psgd.launch import RunFailed

    command = "psgd suite " + shlex.join(argv)
    try:
        run_suite(experiments, results, a.fresh, command, only, profile)
    except (SuiteError, RunFailed) as e:  # one line naming the experiment or the failed process
        print(f"psgd suite: failed: {e}", file=sys.stderr)
        return 1
    return 0
