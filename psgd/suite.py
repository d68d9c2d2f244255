"""`psgd suite FILE.toml`: run every experiment of a suite, then write figures, CSVs and REPORT.md.

Contract:
- A suite file names experiment files (`[suite] experiments = [...]`, relative to it). An
  experiment file is one claim: `id`, `title`, `claim`, `quote` (the seed article's words),
  `analysis` (which analysis in psgd/analyses.py reads its runs), `seeds`, a `[base]` table of
  run settings, `[[runs]]` (each a `label` plus settings that override base), optional
  `[params]` for the analysis, and `[profiles.quick]` / `[profiles.full]` overrides of base (and
  of `seeds`; they win over base and runs). A benchmark experiment has `bench = "NAME"` and
  `[bench_args]` (flags; true = a bare flag, "{out}" = the experiment's results folder) instead
  of runs; what the benchmark prints is kept as `RESULTS/<id>/bench.json` (with `json = true`)
  or `bench.txt`.
  Settings are RunConfig field names (`workers`, `lr`, `straggler = ["0=40"]`, ...); a bad key
  or value is a one-line error naming the file and the key.
- Runs go to `RESULTS/runs/<id>/<label>-s<seed>/`; a run whose config.json matches and that has a
  summary.json is reused (`--fresh` reruns it). Each experiment writes `RESULTS/<id>/` (PNG, CSV,
  `commands.txt` with the exact commands) and the suite writes `RESULTS/REPORT.md`.

    psgd suite experiments/default.toml              # what `make experiments` runs
    psgd suite experiments/default.toml --only E2,E3   # rerun two; the report still covers all
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
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

EXPERIMENT_KEYS = {"id", "title", "claim", "quote", "analysis", "seeds", "base", "runs", "profiles", "params",
                   "bench", "bench_args"}
PROFILES = ("default", "quick", "full")


class SuiteError(ValueError):
    """A bad suite or experiment file; the message names the file and the key."""


@dataclass(frozen=True)
class RunSpec:
    experiment: str
    label: str
    seed: int
    cfg: C.RunConfig

    @property
    def command(self) -> str:
        return "psgd run " + shlex.join(C.to_argv(self.cfg))


@dataclass(frozen=True)
class Experiment:
    id: str
    title: str
    claim: str
    quote: str
    analysis: str
    path: Path
    runs: tuple[RunSpec, ...] = ()
    bench: str = ""
    bench_args: tuple[str, ...] = ()
    params: dict = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return self.id


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


def load_experiment(path: Path, profile: str, results: Path) -> Experiment:
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
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise SuiteError(f"{path}: key 'seeds' must be a non-empty list of integers")
    common = dict(exp_id=exp_id, title=doc["title"], claim=doc["claim"], quote=doc.get("quote", ""),
                  analysis=doc["analysis"], path=path, params=dict(doc.get("params", {})))
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
        return _experiment(common, bench=str(doc["bench"]), bench_args=tuple(argv))
    runs_doc = doc.get("runs")
    if not isinstance(runs_doc, list) or not runs_doc:
        raise SuiteError(f"{path}: needs at least one [[runs]] table (or bench = ...)")
    base = doc.get("base", {})
    runs, labels = [], set()
    for i, run in enumerate(runs_doc):
        run = dict(run)
        label = run.pop("label", None)
        if not isinstance(label, str) or not label:
            raise SuiteError(f"{path}: [[runs]] #{i + 1} needs a 'label'")
        if label in labels:
            raise SuiteError(f"{path}: [[runs]] label {label!r} is used twice")
        labels.add(label)
        for seed in seeds:
            slug = re.sub(r"[^A-Za-z0-9.=_-]+", "_", label)
            # A profile's overrides win over base and run settings: --quick must be quick everywhere.
            settings = {**base, **run, **overrides, "seed": seed,
                        "out": str(results / "runs" / exp_id / f"{slug}-s{seed}")}
            runs.append(RunSpec(exp_id, label, seed, config_from_settings(settings, f"{path} [[runs]] {label!r}")))
    return _experiment(common, runs=tuple(runs))


def _experiment(common: dict, **kw) -> Experiment:
    c = dict(common)
    return Experiment(id=c.pop("exp_id"), **c, **kw)


def load_suite(path: Path, profile: str = "default", only: set[str] | None = None,
               results: Path = Path("results")) -> list[Experiment]:
    doc = _read_toml(path)
    names = doc.get("suite", {}).get("experiments")
    if not isinstance(names, list) or not names:
        raise SuiteError(f"{path}: needs [suite] experiments = [\"file.toml\", ...]")
    experiments = [load_experiment(path.parent / n, profile, results) for n in names]
    ids = [e.id for e in experiments]
    if len(set(ids)) != len(ids):
        raise SuiteError(f"{path}: experiment ids repeat: {ids}")
    if only:
        missing = only - set(ids)
        if missing:
            raise SuiteError(f"--only names unknown experiments {sorted(missing)}; the suite has {', '.join(ids)}")
    return experiments


# -- running --------------------------------------------------------------------------------------------
SECONDS_PER_RUN_START = 6.0   # process start-up + evaluation of one `psgd run` on 2 cores (measured)
SECONDS_PER_STEP = 0.02       # one step of a small model, 4 workers (measured; only for the ETA)


def estimate_s(experiments: list[Experiment]) -> float:
    runs = [r for e in experiments for r in e.runs]
    return sum(SECONDS_PER_RUN_START + SECONDS_PER_STEP * r.cfg.steps * max(1, r.cfg.workers // 2) for r in runs) + \
        sum(60.0 for e in experiments if e.bench)


def is_cached(spec: RunSpec) -> bool:
    out = Path(spec.cfg.out)
    try:
        recorded = json.loads((out / "config.json").read_text())
        # Compare through JSON: tuples in the dataclass are lists in the file.
        return (out / "summary.json").exists() and recorded == json.loads(json.dumps(C.to_dict(spec.cfg)))
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
        tqdm.write(f"{position} {spec.experiment} {spec.label} seed {spec.seed}: cached")
        return json.loads((Path(spec.cfg.out) / "summary.json").read_text())
    cfg = C.with_epochs_resolved(spec.cfg, data.train_size(spec.cfg.data))
    bar = tqdm(total=cfg.budget, desc=f"{position} {spec.experiment} {spec.label} s{spec.seed}", unit="grad",
               leave=False, dynamic_ncols=True, file=sys.stderr)
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
    (Path(cfg.out) / "config.json").write_text(json.dumps(C.to_dict(spec.cfg), indent=1))
    return summary


def _has_results(exp: Experiment, results: Path) -> bool:
    """Whether an experiment that is not being run has finished results to analyse."""
    if exp.bench:
        return any((results / exp.id / name).exists() for name in ("bench.json", "bench.txt"))
    return all(is_cached(spec) for spec in exp.runs)


def run_suite(experiments: list[Experiment], results: Path, fresh: bool = False, command: str = "",
              only: set[str] | None = None) -> Path:
    """Run the experiments (all, or those in `only`), then analyse every experiment that has results
    and write the whole report; returns the REPORT.md path."""
    from psgd import analyses, report

    chosen = [e for e in experiments if only is None or e.id in only]
    runs = [r for e in chosen for r in e.runs]
    benches = [e for e in chosen if e.bench]
    eta = estimate_s(chosen)
    print(f"psgd suite: {len(chosen)} experiments, {len(runs)} runs and {len(benches)} benchmarks; "
          f"about {eta / 60:.0f} min on a 2-core CPU machine (cached runs are reused; --fresh reruns them)",
          file=sys.stderr, flush=True)
    started = time.time()
    sections, reused = [], 0
    overall = tqdm(total=len(runs) + len(benches), desc="suite", unit="run", dynamic_ncols=True, file=sys.stderr)
    for exp in experiments:
        out = results / exp.id
        if exp not in chosen:
            # --only: the report still covers the whole suite, from the results already there.
            if _has_results(exp, results):
                summaries = [(s, json.loads((Path(s.cfg.out) / "summary.json").read_text())) for s in exp.runs]
                sections.append(analyses.analyse(exp, summaries, out))
            else:
                tqdm.write(f"{exp.id}: not run yet, left out of the report (run the suite without --only)")
            continue
        out.mkdir(parents=True, exist_ok=True)
        summaries = []
        for spec in exp.runs:
            reused += int(not fresh and is_cached(spec))
            summaries.append((spec, execute(spec, fresh, f"[{overall.n + 1}/{overall.total}]")))
            overall.update(1)
        if exp.bench:
            from psgd import bench

            where = f"[{overall.n + 1}/{overall.total}] {exp.id}"
            tqdm.write(f"{where}: psgd bench {exp.bench} {shlex.join(exp.bench_args)}")
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                rc = bench.main([exp.bench, *exp.bench_args])
            if rc:
                raise SuiteError(f"{exp.id}: psgd bench {exp.bench} exited with {rc}")
            name = "bench.json" if "--json" in exp.bench_args else "bench.txt"
            (out / name).write_text(printed.getvalue())
            overall.update(1)
        commands = [f"psgd bench {exp.bench} {shlex.join(exp.bench_args)}"] if exp.bench else \
            [s.command for s, _ in summaries]
        (out / "commands.txt").write_text(
            f"# made by: {command or 'psgd suite'}\n# experiment file: {exp.path}\n" + "\n".join(commands) + "\n")
        sections.append(analyses.analyse(exp, summaries, out))
    overall.close()
    path = report.write(results, sections, command=command, wall_s=time.time() - started,
                        note=f"{reused} of {len(runs)} runs reused from earlier invocations" if reused else "")
    print(f"psgd suite: wrote {path} ({(time.time() - started) / 60:.1f} min)", file=sys.stderr)
    return path


def main(argv: list[str]) -> int:
    from psgd.cli import Parser, UsageError

    p = Parser(prog="psgd suite", description="Run an experiment suite and write figures, CSVs and REPORT.md.")
    p.add_argument("suite", type=Path, help="suite file, e.g. experiments/default.toml")
    p.add_argument("--only", default="", help="comma-separated experiment ids to run, e.g. E2,E3")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="smoke profile: tiny budgets, one seed")
    group.add_argument("--full", action="store_true", help="more workers, steps and seeds (more cores / GPUs)")
    p.add_argument("--results", type=Path, default=Path("results"), help="output folder (default results/)")
    p.add_argument("--fresh", action="store_true", help="rerun runs even when a matching result exists")
    a = p.parse_args(argv)
    profile = "quick" if a.quick else "full" if a.full else "default"
    only = {s.strip() for s in a.only.split(",") if s.strip()} or None
    try:
        experiments = load_suite(a.suite, profile, only, a.results)
    except SuiteError as e:
        raise UsageError(str(e)) from None
    from psgd.launch import RunFailed

    command = "psgd suite " + shlex.join(argv)
    try:
        run_suite(experiments, a.results, a.fresh, command, only)
    except (SuiteError, RunFailed) as e:  # one line naming the experiment or the failed process
        print(f"psgd suite: failed: {e}", file=sys.stderr)
        return 1
    return 0
