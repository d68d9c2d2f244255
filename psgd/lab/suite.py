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
  psgd/lab/provenance.py), made by psgd/lab/runner.py: identical runs of different experiments
  are made once, a run made by other training code is never reused, and a change to an analysis
  re-analyses finished runs. A finished run (psgd/lab/runcache.py: summary.json, matching
  config.json and provenance.json; a run on a `psgd cluster`, only while the cluster of its name
  has the link it ran on) is reused unless
  `--fresh`. Each experiment writes `RESULTS/<id>/` (PNG, CSV, `commands.txt` with the exact
  commands, tuning ones included) and the suite writes `RESULTS/REPORT.md` and
  `RESULTS/summary.json` (verdicts, key numbers, code version, wall time). A suite file may name
  the seed articles' summary (`[suite] articles = "seed_articles.toml"`, psgd/lab/articles.py),
  which the report prints once.

    psgd suite experiments/default.toml              # what `make experiments` runs
    psgd suite default                               # the same suite by name (an installed psgd ships it)
    psgd suite --list                                # the suites there are, with their experiments
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
import io
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from psgd.lab.articles import Article, suite_articles
from psgd.lab.experiment import PROFILES, Experiment, RunSpec, SuiteError, choose, run_digest, score
from psgd.lab.loader import load_experiment, load_suite
from psgd.lab.provenance import code_version, run_code_version
from psgd.lab.runcache import is_cached, reference_summary
from psgd.lab.runner import WARM, Runner, estimate_s, pin_cpu_kernels
from psgd.lab.settings import config_from_settings, known_keys

__all__ = ["PROFILES", "Experiment", "RunSpec", "SuiteError", "choose", "config_from_settings", "known_keys",
           "load_experiment", "load_suite", "run_digest", "score", "tuning_of", "is_cached", "made_by", "run_suite",
           "main"]


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


def _made_as(results: Path, profile: str, run_version: str) -> dict | None:
    """The summary.json of the invocation that ran this folder's runs (same profile, and runs by the
    same training code as now: a summary left by an invocation whose runs were since made again by
    other code says nothing of these), which a re-analysis keeps as the report's command, date, wall
    time and machine; None where there is none."""
    path = results / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    keys = ("command", "date", "wall_s", "machine")
    same = summary.get("profile") == profile and summary.get("run_code_version") == run_version
    return summary if same and all(k in summary for k in keys) else None


def _kernels_of(pending: list) -> str | None:
    """The CPU kernels the analysed runs recorded (provenance.json), for the report's machine line: a
    re-analysis pins none of its own (the suite's runs are pinned: `pin_cpu_kernels`). None where no
    run recorded them."""
    found = set()
    for _, summaries, *_ in pending:
        for item in summaries:
            try:
                found.add(json.loads((Path(item[0].cfg.out) / "provenance.json").read_text()).get("cpu_kernels"))
            except (OSError, ValueError, AttributeError, TypeError, IndexError):
                continue
    found.discard(None)
    return ", ".join(sorted(found)) or None


def _steps(exps: list[Experiment], done: set[str]) -> int:
    """The runs (each made once, however many experiments share it) and benchmarks still to make, as
    planned before tuning: each tuned label at its grid's first rate."""
    outs = {s.cfg.out for e in exps for s in (*e.tune_specs(), *e.planned_specs())} - done
    return len(outs) + sum(1 for e in exps if e.bench)


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
    return _steps(chosen_exps, set())


def _run_experiment(exp: Experiment, out: Path, runner: Runner, command: str) -> tuple[tuple, set[str]]:
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


def _analysed(analyses, exp: Experiment, *args):
    """One experiment's section; an analysis that cannot read its runs is a SuiteError naming it (one
    line), its runs kept for `--report` once the file is fixed."""
    try:
        return analyses.analyse(exp, *args)
    except (ValueError, KeyError, IndexError) as e:
        raise SuiteError(f"{exp.id}: analysis {exp.analysis!r} could not read its runs: "
                         f"{e if isinstance(e, ValueError) else f'{type(e).__name__}: {e}'} "
                         "(the runs are kept: fix the file and rerun with --report)") from None


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
    runner = Runner(overall, fresh, tensorboard)
    done: dict[str, tuple[tuple, set[str]] | None] = {}  # id -> (entry to analyse, made_by), None: no results
    try:
        for i, exp in enumerate(chosen_exps):
            runner.expect(_steps(chosen_exps[i:], runner.done_outs))   # the bar ends at its total
            done[exp.id] = _run_experiment(exp, results / exp.id, runner, command)
    finally:
        WARM.close()  # the suite's runs are over: its warm parent goes
    runner.expect(0)
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
        sections = [_analysed(analyses, *args) for args in pending]
    note = (f"{runner.reused} of {runner.total_runs} runs reused from earlier invocations (for a reference profile, "
            "the default profile's runs of the same configs too)" if runner.reused else "")
    made_as = None
    if only == set():
        note = "--report: re-analysed the finished runs and benchmark outputs; nothing was run"
        made_as = _made_as(results, profile, run_version)
    path = report.write(results, sections, command=command, wall_s=time.time() - started, note=note,
                        version=version, run_version=run_version, profile=profile, articles=articles,
                        made_by=made, noise=floor, reference=reference_summary(results), made_as=made_as,
                        kernels=_kernels_of(pending))
    print(f"psgd suite: wrote {path} ({(time.time() - started) / 60:.1f} min)", file=sys.stderr)
    return path


def _parser():
    from psgd.core.errors import Parser

    p = Parser(prog="psgd suite", description="Tune and run an experiment suite; write figures, CSVs and REPORT.md.")
    p.add_argument("suite", nargs="?", default=None,
                   help="a suite file (experiments/default.toml) or the name of one psgd ships (default, "
                        "transformer, papers: psgd suite --list)")
    p.add_argument("--list", action="store_true", help="list the suites psgd has, with their experiments, and exit")
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
    return p


def main(argv: list[str]) -> int:
    from psgd.core.errors import UsageError
    from psgd.lab import analyses, suites

    a = _parser().parse_args(argv)
    if a.list:
        print(suites.listing())
        return 0
    if a.suite is None:
        raise UsageError("name a suite file or a suite (e.g. psgd suite default); psgd suite --list lists them")
    a.suite = suites.resolve(a.suite)
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
        if problem := next((m for e in experiments if (m := analyses.missing_runs(e))), ""):
            raise SuiteError(problem)   # before any run: an analysis must find the runs it reads
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
    if a.report and not any(_has_results(e) for e in experiments):
        raise UsageError(f"--report re-analyses finished runs, and {results} has none of this suite's "
                         "(run the suite first)")
    from psgd.train.supervise import RunFailed

    command = "psgd suite " + shlex.join(argv)
    if not a.report:
        pin_cpu_kernels()
    try:
        run_suite(experiments, results, a.fresh, command, only, profile, articles, a.tensorboard)
    except (SuiteError, RunFailed) as e:  # one line naming the experiment or the failed process
        print(f"psgd suite: failed: {e}", file=sys.stderr)
        return 1
    return 0
