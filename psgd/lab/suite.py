"""`psgd suite FILE.toml`: tune, run every experiment of a suite, then write figures, CSVs and REPORT.md.

Contract:
- A suite file names experiment files (`[suite] experiments = [...]`, relative to it) and may
  hold a `[base]` and `[profiles.quick]` / `[profiles.full]` of settings shared by every learning
  experiment (an experiment's own tables win; bench experiments ignore them). The experiment
  files' schema, the grids, the evaluation grid and the tuning rules are in psgd/lab/experiment.py.
- For each experiment, in order: the tuning runs (validation only), the choice of rates, the
  evaluated runs at those rates (or the benchmark). The test set is never looked at while
  choosing. Once all have run, the noise floor (an experiment whose [params] name two identical
  algorithms, `noise_floor = ["sync", "allreduce"]`: analysis_kit.noise_floor_of) is measured
  and every analysis runs with it as the least accuracy margin (psgd/lab/verdicts.py).
- Runs go to `RESULTS/runs/<digest>/` (config + the training code's version,
  psgd/lab/provenance.py): identical runs of different experiments are made once, a run made by other
  training code is never reused, and a change to an analysis re-analyses finished runs. A
  finished run (summary.json, matching config.json and provenance.json; a run on a `psgd
  cluster`, only while the cluster of its name has the link it ran on) is reused unless
  `--fresh`. Each experiment writes `RESULTS/<id>/` (PNG, CSV, `commands.txt` with the exact
  commands, tuning ones included) and the suite writes `RESULTS/REPORT.md` and
  `RESULTS/summary.json` (verdicts, key numbers, code version, wall time). A suite file may name
  the seed articles' summary (`[suite] articles = "seed_articles.toml"`, psgd/lab/articles.py),
  which the report prints once.

    psgd suite experiments/default.toml              # what `make experiments` runs
    psgd suite experiments/default.toml --only E2,E3   # rerun two; the report still covers all
    psgd suite experiments/default.toml --full       # 5 seeds, wider sweeps: results/full/
    psgd suite experiments/default.toml --reference  # power-sized seeds per claim: results/reference/

    psgd suite experiments/default.toml --report     # re-analyse finished runs, run nothing

Runs live under RESULTS/runs/, which git ignores: a fresh clone has the reports but none of their
runs. `--only` and `--report` rewrite the whole report from the runs they find, so where the report
holds an experiment whose runs are not here they keep it: `--report` refuses (one line, exit 2);
`--only` makes its runs (and its experiments' folders) and leaves REPORT.md and summary.json as
they were, saying so, for the whole suite to rewrite (it reuses those runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from psgd.core import config as C
from psgd.lab.articles import Article, suite_articles
from psgd.lab.experiment import (
    PROFILES,
    Experiment,
    RunSpec,
    SuiteError,
    choose,
    config_from_settings,
    known_keys,
    load_experiment,
    load_suite,
    run_digest,
    score,
)
from psgd.lab.provenance import code_version, run_code_version

__all__ = ["PROFILES", "Experiment", "RunSpec", "SuiteError", "choose", "config_from_settings", "known_keys",
           "load_experiment", "load_suite", "run_digest", "score", "tuning_of", "is_cached", "run_suite", "main"]


# -- tuning -------------------------------------------------------------------------------------------
def tuning_of(exp: Experiment) -> tuple[dict[str, float], dict[tuple[str, float], list[float]]]:
    """(chosen rate per label, scores) from the finished tuning runs, each grid grown as far as its
    runs were made (psgd/lab/tuning.py settle)."""
    _, chosen, scores = _settled(exp, None)
    return chosen, scores


def _settled(exp: Experiment, make) -> tuple[Experiment, dict[str, float], dict[tuple[str, float], list[float]]]:
    """(the experiment with its grids grown until every pick is inside, chosen rates, scores):
    `make` runs tuning runs; None reads those already made."""
    from psgd.lab import tuning

    settled, chosen, scores, _ = tuning.settle(exp, make, lambda s: is_cached(s, same_link=False))
    return settled, chosen, scores


# -- running --------------------------------------------------------------------------------------------
# Only for the ETA, fitted to the reference runs on 2 cores (the default profile: 12.2 min for 211
# runs and 2 benchmarks, mostly 96k-sample MLP runs; the transformer suite: 11.0 min for 68 runs):
# start-up from the warm parent (0.46 s on average) plus the evaluation of an MLP run's snapshots,
# and the training samples per second of a typical run.
SECONDS_PER_RUN_START = 1.0
SAMPLES_PER_S = 40000
# The small transformer (E14, E17, E18, E22 at width 64): about 1,950 training samples (windows) per
# second, and about 0.8 s per evaluation of a snapshot on the validation and test text (fitted on the
# transformer suite of fe4506d: 28.0 min for 87 runs of 11 evaluations each, where 2.2 s per run had
# predicted 18.1 min).
SLOWER = {"gpt": (1950, 0.8)}


def estimate_s(experiments: list[Experiment], fresh: bool = False) -> float:
    """About how long the runs still to make take (all of them with `fresh`: none is reused)."""
    from psgd.train import data

    total, seen = 0.0, set()
    for e in experiments:
        if e.bench:
            total += 60.0
        specs = e.tune_specs() + e.planned_specs()
        for r in specs:
            if r.cfg.out in seen or (not fresh and (is_cached(r) or _twin(r) is not None)):
                continue
            seen.add(r.cfg.out)
            cfg = C.with_epochs_resolved(r.cfg, data.train_size(r.cfg.data))
            rate, per_eval = SLOWER.get(cfg.model.model, (SAMPLES_PER_S, 0.0))
            # Evaluations: the start, one every eval_every updates, the end.
            evals = 1 + (-(-C.updates(cfg) // cfg.eval_every) if cfg.eval_every > 0 else 1)
            total += SECONDS_PER_RUN_START + per_eval * evals + cfg.steps * cfg.global_batch / rate
    return total


def is_cached(spec: RunSpec, same_link: bool = True) -> bool:
    """Whether spec's folder holds its finished run: the same config, made by the same training code
    and, for a run on a `psgd cluster` (--hosts), on the link of the cluster of that name up now
    (`same_link`; no such cluster: not reusable). The config names the cluster, not its link, and
    `psgd cluster up` may make the name again with another link. same_link=False: the run is
    finished, whatever link it had (re-analysing finished runs)."""
    out = Path(spec.cfg.out)
    try:
        recorded = json.loads((out / "config.json").read_text())
        made_by = json.loads((out / "provenance.json").read_text())
        # Compare through JSON: tuples in the dataclass are lists in the file.
        from psgd.train.launch import config_record  # noqa: PLC0415 - the config and the user's files' hashes

        # `out` aside: a reference run copied from the default profile's folder names where it was made.
        return ((out / "summary.json").exists()
                and _out_aside(recorded) == _out_aside(json.loads(json.dumps(config_record(spec.cfg))))
                and made_by.get("code_version") == spec.version
                and (not same_link or not spec.cfg.hosts or _on_the_same_link(spec.cfg, out)))
    except (OSError, ValueError):
        return False


def _out_aside(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "out"}


def default_folder(results: Path) -> Path | None:
    """The default profile's folder beside a reference profile's (results/reference/ -> results/,
    results/transformer-reference/ -> results/transformer/): `reference_summary`'s inverse."""
    if results.name == "reference":
        return results.parent
    if results.name.endswith("-reference"):
        return results.parent / results.name.removesuffix("-reference")
    return None


def _twin(spec: RunSpec) -> RunSpec | None:
    """The default profile's finished run of a reference run's config, where there is one: the same
    folder name (psgd/lab/experiment.py `run_digest`: the config, `out` aside, and the training code)
    under the default profile's runs/, made by the same training code. The reference profile's seeds
    begin with the default profile's (psgd/lab/power.py), and their tuning runs are the same runs."""
    out = Path(spec.cfg.out)
    home = default_folder(out.parent.parent)
    if home is None or out.exists():
        return None
    twin = dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg, out=str(home / "runs" / out.name)))
    return twin if is_cached(twin) else None


def reuse_twin(spec: RunSpec) -> bool:
    """Take the default profile's finished run of this reference run's config (`_twin`) into the
    reference's folder, by hard links (copies across file systems), rather than run it again; returns
    whether it did. Its files are as they were made: config.json's `out` names the folder it ran in."""
    twin = _twin(spec)
    if twin is None:
        return False

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    shutil.copytree(twin.cfg.out, spec.cfg.out, copy_function=link)
    return True


def _on_the_same_link(cfg: C.RunConfig, out: Path) -> bool:
    from psgd.cluster import netns
    from psgd.train import hosts

    c = netns.load(cfg.cluster)
    if c is None or not c.complete:
        return False
    now = hosts.link_record(c, cfg.mode)
    then = json.loads((out / "summary.json").read_text()).get("cluster") or {}
    return {k: then.get(k) for k in now} == now
class _WarmParent:
    """One warm parent for every run the suite makes (psgd/train/launch.py `warm_parent`): torch is
    imported once per suite, not once per run (about 1.2 s of a run's start-up on 2 cores). Started
    at the first run, replaced if it died, closed when the suite ends (and it dies with the suite's
    process in any case: PR_SET_PDEATHSIG)."""

    def __init__(self, tag: str = "psgd-suite") -> None:
        self.zygote, self.tag = None, tag   # the tag names the warm parent in `ps` (tests: psgd-tests)

    def get(self):
        from psgd.train import launch

        if self.zygote is None or self.zygote.gone:
            self.close()
            self.zygote = launch.warm_parent(self.tag)
        return self.zygote

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None


WARM = _WarmParent()

# torch picks its CPU kernels by the machine (AVX2, AVX-512, ...), and a run's last bits follow them:
# the same sync run hashes differently on an AVX-512 machine than on an AVX2 one (measured: 537f4dc0...
# against 41ce5e7b...). The suite pins AVX2, which every x86 machine since 2013 has, so that its runs
# do not change with a machine's vector width; a value the caller set is kept. `machine()` in the
# report and each run's provenance.json name it. It cannot pin everything: matrix products go to
# MKL, which picks its kernels by CPU vendor (measured: one sync case, AMD EPYC and Intel Xeon
# AVX-512, two hashes; tests/numerics.py), so a rerun's bits are the committed ones on the same
# class of CPU; elsewhere a seed can end on other last bits.
PINNED_KERNELS = "avx2"


def pin_cpu_kernels() -> str:
    """Set ATEN_CPU_CAPABILITY for the processes the suite starts (not this one); returns its value."""
    import torch  # noqa: PLC0415

    have = torch.backends.cpu.get_cpu_capability().lower()
    if "ATEN_CPU_CAPABILITY" not in os.environ and have.startswith("avx"):
        os.environ["ATEN_CPU_CAPABILITY"] = PINNED_KERNELS
    return os.environ.get("ATEN_CPU_CAPABILITY", have)


def execute(spec: RunSpec, fresh: bool, position: str, tensorboard: Path | None = None) -> dict:
    """Run one spec (or reuse its cached result); returns its summary. With `tensorboard`, the
    run's curves go to TENSORBOARD/<experiment>/<label>-<phase>-lr<lr>-s<seed> as it trains (a cached
    run's from its files: psgd/train/tboard.py)."""
    from psgd.train import data, launch, progress

    cached = not fresh and is_cached(spec)
    linked = not fresh and not cached and reuse_twin(spec)
    if cached or linked:
        said = "the default profile's run, linked in" if linked else "cached"
        tqdm.write(f"{position} {spec.experiment} {spec.label} seed {spec.seed}: {said}", file=sys.stderr)
        _tensorboard(spec, tensorboard)
        return json.loads((Path(spec.cfg.out) / "summary.json").read_text())
    cfg = C.with_epochs_resolved(spec.cfg, data.train_size(spec.cfg.data))
    tag = f"{position} {spec.experiment} {spec.label}" + (f" lr={spec.cfg.optim.lr:g}" if spec.phase == "tune" else "")
    with progress.live(Path(cfg.out), cfg.budget, f"{tag} s{spec.seed}"):
        summary = launch.run(cfg, zygote=WARM.get(), tensorboard=_tensorboard_dir(spec, tensorboard))
    # Record the config as specified (before --epochs was resolved), so the cache check matches.
    out = Path(cfg.out)
    (out / "config.json").write_text(json.dumps(launch.config_record(spec.cfg), indent=1))
    (out / "provenance.json").write_text(json.dumps({"code_version": spec.version, "command": spec.command,
                                                     "made_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                     "cpu_kernels": os.environ.get("ATEN_CPU_CAPABILITY", "")},
                                                    indent=1))
    return summary


def _tensorboard_dir(spec: RunSpec, tensorboard: Path | None) -> Path | None:
    """TENSORBOARD/<experiment>/<label>-<phase>-lr<lr>-s<seed>: a run's curves, written as it trains."""
    if tensorboard is None:
        return None
    name = f"{spec.label}-{spec.phase}-lr{spec.cfg.optim.lr:g}-s{spec.seed}".replace(" ", "_").replace("/", "_")
    return tensorboard / spec.experiment / name


def _tensorboard(spec: RunSpec, tensorboard: Path | None) -> None:
    """A cached run's curves, from its files (psgd/train/tboard.py `write`)."""
    if tensorboard is not None:
        from psgd.train import tboard

        tboard.write(Path(spec.cfg.out), _tensorboard_dir(spec, tensorboard))


def _has_results(exp: Experiment) -> bool:
    """Whether an experiment that is not being run has finished results to analyse."""
    if exp.bench:
        return any((exp.results / exp.id / name).exists() for name in ("bench.json", "bench.txt"))
    if not all(is_cached(spec, same_link=False) for spec in exp.tune_specs()):
        return False
    return all(is_cached(spec, same_link=False) for spec in exp.final_specs(tuning_of(exp)[0]))


def would_drop(experiments: list[Experiment], only: set[str] | None, results: Path) -> list[str]:
    """The experiments that `results`' report covers (its summary.json's claims) but that a call
    running only `only` (--only; set() for --report) could not analyse again: their finished runs
    (by the training code at hand: `is_cached`) are not here, as in a fresh clone (runs are not in
    git) or after a change to the training code. Writing the report would drop them."""
    if only is None:
        return []  # the whole suite: it makes what is missing
    try:
        reported = {c["id"] for c in json.loads((results / "summary.json").read_text())["claims"]}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [e.id for e in experiments if e.id not in only and e.id in reported and not _has_results(e)]


def _run_bench(exp: Experiment, out: Path, where: str) -> None:
    from psgd import bench

    tqdm.write(f"{where}: psgd bench {exp.bench} {shlex.join(exp.bench_args)}", file=sys.stderr)
    (out / "not_testable.txt").unlink(missing_ok=True)
    if exp.bench == "cluster":
        # The kernel-shaped cluster needs root (network namespaces): where it cannot be built, the
        # experiment is "not testable here", said with the reason, and the suite goes on.
        from psgd.cluster import netns
        from psgd.core.errors import UsageError

        try:
            netns.need_privileges()
        except UsageError as e:
            (out / "not_testable.txt").write_text(str(e) + "\n")
            tqdm.write(f"{where}: not testable here: {e}", file=sys.stderr)
            return
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = bench.main([exp.bench, *exp.bench_args])
    if rc:
        raise SuiteError(f"{exp.id}: psgd bench {exp.bench} exited with {rc}")
    name = "bench.json" if "--json" in exp.bench_args else "bench.txt"
    (out / name).write_text(printed.getvalue())


def made_by(exp: Experiment, finals: list[RunSpec]) -> set[str]:
    """The training-code versions that made what an experiment's section cites: each evaluated
    run's own provenance.json (written when it ran), or for a benchmark the version its
    commands.txt recorded when it ran (its output carries no provenance of its own). Read from the
    files, never assumed from the code at hand: a re-analysis (--report, --only) states what made
    the runs, not what would make them now."""
    if exp.bench:
        head = (exp.results / exp.id / "commands.txt")
        for line in (head.read_text().splitlines() if head.exists() else []):
            if line.startswith("# code version: "):
                return {line.removeprefix("# code version: ").strip()}
        return {"unknown"}
    versions = set()
    for spec in finals:
        try:
            versions.add(json.loads((Path(spec.cfg.out) / "provenance.json").read_text())["code_version"])
        except (OSError, ValueError, KeyError):
            versions.add("unknown")
    return versions


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


def reference_summary(results: Path) -> dict | None:
    """The reference profile's summary.json beside a default profile's folder (results/ ->
    results/reference/, results/transformer/ -> results/transformer-reference/), or None."""
    folder = results / "reference" if results.name == "results" else results.parent / f"{results.name}-reference"
    path = folder / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def _made_as(results: Path, profile: str) -> dict | None:
    """The summary.json of the invocation that ran this folder's runs (same profile), which a re-analysis
    keeps as the report's command, date, wall time and machine; None where there is none."""
    path = results / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    keys = ("command", "date", "wall_s", "machine")
    return summary if summary.get("profile") == profile and all(k in summary for k in keys) else None


def _announce(chosen_exps: list[Experiment], fresh: bool, profile: str, version: str, run_version: str) -> int:
    """Print what the suite will make and about how long it takes; returns its steps (runs and benchmarks)."""
    eta = estimate_s(chosen_exps, fresh)
    n_tune = len({s.cfg.out for e in chosen_exps for s in e.tune_specs()})
    n_final = len({s.cfg.out for e in chosen_exps for s in e.planned_specs()})
    benches = [e for e in chosen_exps if e.bench]
    print(f"psgd suite ({profile}, code {version}, runs keyed by training code {run_version}): "
          f"{len(chosen_exps)} experiments, {n_tune} tuning runs, "
          f"{n_final} evaluated runs and {len(benches)} benchmarks; about {eta / 60:.0f} min on a 2-core CPU machine "
          f"(finished runs are reused; --fresh reruns them)", file=sys.stderr, flush=True)
    return n_tune + n_final + len(benches)


class _Runner:
    """A suite's runs on its progress bar: a run experiments share is made once; `reused` counts those found."""

    def __init__(self, overall: tqdm, fresh: bool, tensorboard: Path | None) -> None:
        self.overall, self.fresh, self.tensorboard = overall, fresh, tensorboard
        self.reused, self.total_runs = 0, 0
        self.done_outs: set[str] = set()   # the runs made (or reused) so far: a shared run is counted once

    def run_all(self, specs: list[RunSpec]) -> list[tuple[RunSpec, dict]]:
        """Run (or reuse) each spec in order; returns each with its summary."""
        out = []
        for spec in specs:
            first = spec.cfg.out not in self.done_outs
            if first:
                self.reused += int(not self.fresh and (is_cached(spec) or _twin(spec) is not None))
                self.total_runs += 1
            out.append((spec, execute(spec, self.fresh and first, f"[{self.overall.n + 1}/{self.overall.total}]",
                                      self.tensorboard)))
            if first:
                self.done_outs.add(spec.cfg.out)
                self.overall.update(1)
        return out


def _run_experiment(exp: Experiment, out: Path, runner: _Runner, command: str) -> tuple[tuple, set[str]]:
    """Tune, run (or bench) one experiment and write its commands.txt; returns (entry to analyse, made_by)."""
    out.mkdir(parents=True, exist_ok=True)
    exp, chosen, scores = _settled(exp, runner.run_all)   # the sweep, grown where a pick sat at an edge
    tune_specs = exp.tune_specs()
    finals = exp.final_specs(chosen)
    summaries = runner.run_all(finals)
    if exp.bench:
        _run_bench(exp, out, f"[{runner.overall.n + 1}/{runner.overall.total}] {exp.id}")
        runner.overall.update(1)
    (out / "commands.txt").write_text(_commands(exp, tune_specs, finals, command))
    return (exp, summaries, out, chosen, scores), made_by(exp, finals)


def _finished_experiment(exp: Experiment, out: Path) -> tuple[tuple, set[str]] | None:
    """An experiment not run now, from its finished results: as `_run_experiment`, or None where it has none."""
    if not _has_results(exp):
        tqdm.write(f"{exp.id}: not run yet, left out of the report (run the suite without --only)", file=sys.stderr)
        return None
    exp, chosen, scores = _settled(exp, None)
    finals = exp.final_specs(chosen)
    summaries = [(s, json.loads((Path(s.cfg.out) / "summary.json").read_text())) for s in finals]
    return (exp, summaries, out, chosen, scores), made_by(exp, finals)


def run_suite(experiments: list[Experiment], results: Path, fresh: bool = False, command: str = "",
              only: set[str] | None = None, profile: str = "default", articles: Sequence[Article] = (),
              tensorboard: Path | None = None) -> Path:
    """Tune and run the experiments (all, or those in `only`), then analyse every experiment that has
    results and write the whole report (with the seed `articles`, if any); returns the REPORT.md path."""
    from psgd.lab import analyses, report
    from psgd.lab import verdicts as V
    from psgd.lab.analysis_kit import noise_floor_of

    chosen_exps = [e for e in experiments if only is None or e.id in only]   # only = set(): --report
    version = code_version()
    run_version = experiments[0].version if experiments else ""
    steps = _announce(chosen_exps, fresh, profile, version, run_version)
    started = time.time()
    overall = tqdm(total=steps, desc="suite", unit="run", dynamic_ncols=True, file=sys.stderr)
    runner = _Runner(overall, fresh, tensorboard)
    done: dict[str, tuple[tuple, set[str]] | None] = {}  # id -> (entry to analyse, made_by), None: no results
    try:
        for exp in chosen_exps:
            done[exp.id] = _run_experiment(exp, results / exp.id, runner, command)
    finally:
        WARM.close()  # the suite's runs are over: its warm parent goes
    overall.close()
    if dropped := would_drop(experiments, only, results):  # decided after the runs: they may be some
        print(f"psgd suite: kept {results / 'REPORT.md'} as it was: it reports {', '.join(dropped)}, whose finished "
              "runs are not here; the whole suite rewrites it (reusing the runs made now)", file=sys.stderr)
        return results / "REPORT.md"
    # --only: the report still covers the whole suite, from the results already there (read after the
    # runs: an experiment may share the runs just made).
    for exp in experiments:
        if exp.id not in done:
            done[exp.id] = _finished_experiment(exp, results / exp.id)
    ran = [(exp, d) for exp in experiments if (d := done[exp.id]) is not None]
    pending = [d[0] for _, d in ran]                  # (experiment, summaries, out, chosen, scores), in suite order
    made = {exp.id: d[1] for exp, d in ran}           # id -> training-code versions of what its section cites
    # Analysed once everything has run: the noise floor (E1's two identical algorithms) sets the
    # least accuracy margin of every verdict, E0's included, so it is measured first.
    floor = next((f for e, s, *_ in pending if (f := noise_floor_of(e, s)) is not None), None)
    with V.noise_floor(floor.value if floor is not None else 0.0):
        sections = [analyses.analyse(*args) for args in pending]
    note = (f"{runner.reused} of {runner.total_runs} runs reused from earlier invocations (for a reference profile, "
            "the default profile's runs of the same configs too)" if runner.reused else "")
    made_as = None
    if only == set():
        note = "--report: re-analysed the finished runs and benchmark outputs; nothing was run"
        made_as = _made_as(results, profile)
    path = report.write(results, sections, command=command, wall_s=time.time() - started, note=note,
                        version=version, run_version=run_version, profile=profile, articles=articles,
                        made_by=made, noise=floor, reference=reference_summary(results), made_as=made_as)
    print(f"psgd suite: wrote {path} ({(time.time() - started) / 60:.1f} min)", file=sys.stderr)
    return path


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd suite", description="Tune and run an experiment suite; write figures, CSVs and REPORT.md.")
    p.add_argument("suite", type=Path, help="suite file, e.g. experiments/default.toml")
    p.add_argument("--only", default="", help="comma-separated experiment ids to run, e.g. E2,E3")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="smoke profile: tiny budgets, one seed")
    group.add_argument("--full", action="store_true", help="5 seeds, wider sweeps, more configurations (~2 h)")
    group.add_argument("--reference", action="store_true",
                       help="the default runs at the seeds the power rule asks for per claim (each experiment's "
                            "[profiles.reference]; at most about 60 min on 2 cores): results/reference/")
    p.add_argument("--out", "--results", dest="results", type=Path, default=None,
                   help="output folder (default results/, or results/full with --full); --results is its old name")
    p.add_argument("--fresh", action="store_true", help="rerun runs even when a matching result exists")
    p.add_argument("--report", action="store_true",
                   help="run nothing: re-analyse the finished runs (and benchmark outputs) and rewrite the report")
    p.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                   help="write every run's curves as TensorBoard event files under DIR/<experiment>/ as it finishes "
                        "(pip install 'psgd[tensorboard]')")
    a = p.parse_args(argv)
    if a.tensorboard is not None:
        from psgd.train import tboard

        tboard.require()
    profile = "quick" if a.quick else "full" if a.full else "reference" if a.reference else "default"
    results = a.results or (Path("results/full") if a.full else Path("results/reference") if a.reference
                            else Path("results"))
    only = {s.strip() for s in a.only.split(",") if s.strip()} or None
    if a.report:
        if only or a.fresh:
            raise UsageError("--report runs nothing: it cannot be combined with --only or --fresh")
        only = set()
    try:
        # Runs are keyed by the training code's version; the report names the whole code's too.
        experiments = load_suite(a.suite, profile, only, results, run_code_version())
        articles = suite_articles(a.suite, [e.id for e in experiments])
    except SuiteError as e:
        raise UsageError(str(e)) from None
    # A partial call rewrites the whole report: it must not lose what the report holds (psgd never
    # overwrites a complete report with a poorer one; git would be the only way back). --only still
    # makes its runs (a reference is remade so, an experiment at a time) and keeps the report.
    if a.report and (dropped := would_drop(experiments, only, results)):
        raise UsageError(f"{results / 'REPORT.md'} reports {', '.join(dropped)}, whose finished runs by training "
                         f"code {run_code_version()} are not here (runs are not in git: a fresh clone has none); "
                         "--report would rewrite the report without them. "
                         "Run the whole suite (it reuses what it finds), "
                         "or give --out a folder of its own")
    from psgd.train.launch import RunFailed

    command = "psgd suite " + shlex.join(argv)
    if not a.report:
        pin_cpu_kernels()
    try:
        run_suite(experiments, results, a.fresh, command, only, profile, articles, a.tensorboard)
    except (SuiteError, RunFailed) as e:  # one line naming the experiment or the failed process
        print(f"psgd suite: failed: {e}", file=sys.stderr)
        return 1
    return 0
