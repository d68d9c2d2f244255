"""The suite runner, its TOML schema, tuning, caching, and report generation on a tiny --quick suite."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from psgd.core import config as C
from psgd.lab import readme as readme_mod
from psgd.lab import runcache, suite, verdicts
from tests.helpers import processes_mentioning, psgd_main

ROOT = Path(__file__).resolve().parent.parent

TINY_BASE = """
[base]
dataset = "synthetic"
num_samples = 400
model = "logreg"
workers = 2
servers = 1
batch_size = 8
steps = 4
eval_every = 2
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("profile", suite.PROFILES)
@pytest.mark.parametrize("name,least", [("default.toml", 10), ("transformer.toml", 1), ("papers.toml", 1)])
def test_the_suite_files_are_valid(profile, tmp_path, name, least):
    experiments = suite.load_suite(ROOT / "experiments" / name, profile, results=tmp_path)
    assert len(experiments) >= least
    assert all(e.templates or e.bench for e in experiments)
    learning = [e for e in experiments if e.templates]
    if profile != "quick":   # at least 3 seeds per learning configuration, 5 in --full
        assert min(len(e.seeds) for e in learning) >= (5 if profile == "full" else 3)



@pytest.mark.parametrize("profile", ["default", "reference"])
@pytest.mark.parametrize("name", ["default.toml", "transformer.toml", "papers.toml"])
def test_every_learning_run_is_evaluated_at_least_ten_times(profile, name, tmp_path):
    """Scored at its best validation point, a run needs evaluations dense enough that the best is a
    point (issue 34): at least 10 after the start, the end of the budget included."""
    from psgd.core import schema
    from psgd.train import data

    for e in suite.load_suite(ROOT / "experiments" / name, profile, results=tmp_path):
        for spec in e.planned_specs():
            cfg = spec.cfg
            if cfg.epochs > 0:
                cfg = C.with_epochs_resolved(cfg, data.train_size(cfg.data))
            updates = schema.updates(cfg)
            if cfg.eval_every == 0:
                continue  # a timing run (E10's): no learning curve is scored
            evals = updates // cfg.eval_every + (1 if updates % cfg.eval_every else 0)
            assert evals >= 10, (e.id, spec.label, updates, cfg.eval_every)


@pytest.mark.parametrize("text,message", [
    ('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[base]\nstalenes = 1\n[[runs]]\nlabel = "a"\n',
     "unknown key 'stalenes'"),
    ('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[[runs]]\nlabel = "a"\nworkers = "four"\n',
     "key 'workers' must be an integer"),
    ('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[[runs]]\nlabel = "a"\nworkers = 0\n',
     "--workers must be >= 1"),
    ('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[[runs]]\nlabel = "a"\nstraggler = [5]\n',
     "key 'straggler'"),
    ('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\nbogus = 1\n[[runs]]\nlabel = "a"\n',
     "unknown key 'bogus'"),
    ('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[[runs]]\nlabel = "a"\n[[runs]]\nlabel = "a"\n',
     "used twice"),
    ('id = "X"\ntitle = "t"\nanalysis = "modes"\n[[runs]]\nlabel = "a"\n', "'claim' is required"),
    ('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n', "at least one [[runs]]"),
    ('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[[runs]\n', "not valid TOML"),
])
def test_bad_experiment_files_name_file_and_key(tmp_path, text, message):
    path = write(tmp_path, "exp.toml", text)
    with pytest.raises(suite.SuiteError) as err:
        suite.load_experiment(path, "default", tmp_path)
    assert message in str(err.value) and str(path) in str(err.value)


HEAD = 'id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n'


@pytest.mark.parametrize("tables,where,message", [
    # A bad value in [base] that the quick profile overrides is still reported, and in [base].
    ('[base]\nworkers = "four"\n[profiles.quick]\nworkers = 2\n', "[base]", "key 'workers' must be an integer"),
    ('[base]\nstalenes = 1\n', "[base]", "unknown key 'stalenes'"),
    # A typo in a profile other than the one asked for is found too.
    ('[profiles.full]\nepoch = 3\n', "[profiles.full]", "unknown key 'epoch'"),
])
def test_every_table_is_checked_before_a_profile_applies_and_named(tmp_path, tables, where, message):
    path = write(tmp_path, "exp.toml", HEAD + tables + '[[runs]]\nlabel = "a"\n')
    with pytest.raises(suite.SuiteError) as err:
        suite.load_experiment(path, "quick", tmp_path)
    assert f"{path} {where}: {message}" in str(err.value)
    suite_file = write(tmp_path, "suite.toml", '[suite]\nexperiments = ["ok.toml"]\n' + tables)
    write(tmp_path, "ok.toml", HEAD + '[[runs]]\nlabel = "a"\n')
    with pytest.raises(suite.SuiteError) as err:
        suite.load_suite(suite_file, "quick", results=tmp_path)
    assert f"{suite_file} {where}: {message}" in str(err.value)


def test_bad_suite_is_a_one_line_usage_error(tmp_path):
    write(tmp_path, "exp.toml", 'id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[[runs]]\nlabel = "a"\n'
          'lr = -1.0\n')
    suite_file = write(tmp_path, "suite.toml", '[suite]\nexperiments = ["exp.toml"]\n')
    r = psgd_main("suite", str(suite_file))
    assert r.returncode == 2 and "--lr must be > 0" in r.stderr and "exp.toml" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    write(tmp_path, "exp.toml", 'id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[[runs]]\nlabel = "a"\n')
    r = psgd_main("suite", str(suite_file), "--only", "E9")
    assert r.returncode == 2 and "unknown experiments" in r.stderr


def test_grids_expand_with_formatted_labels(tmp_path):
    path = write(tmp_path, "exp.toml", 'id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "staleness"\n' + TINY_BASE
                 + '[[runs]]\nlabel = "N={workers} lr={lr}"\nmode = "async"\nworkers = [1, 2]\nlr = [0.1, 0.3]\n')
    exp = suite.load_experiment(path, "default", tmp_path)
    specs = exp.final_specs({})
    assert [s.label for s in specs] == ["N=1 lr=0.1", "N=1 lr=0.3", "N=2 lr=0.1", "N=2 lr=0.3"]
    assert [(s.cfg.workers, s.cfg.optim.lr) for s in specs] == [(1, 0.1), (1, 0.3), (2, 0.1), (2, 0.3)]


TUNED = ('id = "T"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\nseeds = [0, 1]\n[tune]\nlr = [0.1, 0.3]\n'
         'seeds = [7, 8, 9]\n' + TINY_BASE + 'val_fraction = 0.25\n'
         '[[runs]]\nlabel = "sync"\nmode = "sync"\n'
         '[[runs]]\nlabel = "async"\nmode = "async"\n'
         '[[runs]]\nlabel = "half"\nmode = "sync"\nwire_dtype = "fp16"\nlr_from = "sync"\nlr_factor = 2.0\n'
         '[[runs]]\nlabel = "fixed"\nmode = "sync"\nlr = 0.05\n')


def test_tuning_plan_choice_and_derived_rates(tmp_path):
    exp = suite.load_experiment(write(tmp_path, "t.toml", TUNED), "default", tmp_path, version="v1")
    tune = exp.tune_specs()
    # Two tuned labels x two rates x three tuning seeds; "half" and "fixed" are not swept.
    assert sorted((s.label, s.cfg.optim.lr, s.seed) for s in tune) == [
        (label, lr, seed) for label in ("async", "sync") for lr in (0.1, 0.3) for seed in (7, 8, 9)]
    assert all(s.cfg.data.val_fraction == 0.25 and s.phase == "tune" for s in tune)
    # The best mean validation score wins; a tie goes to the smaller rate; nan (diverged) never wins.
    chosen = suite.choose(exp, {("sync", 0.1): [0.5], ("sync", 0.3): [0.7],
                                ("async", 0.1): [0.6], ("async", 0.3): [0.6]})
    assert chosen == {"sync": 0.3, "async": 0.1}
    assert suite.choose(exp, {("sync", 0.1): [0.2], ("sync", 0.3): [float("nan")]})["sync"] == 0.1
    finals = {(s.label, s.seed): s.cfg.optim.lr for s in exp.final_specs(chosen)}
    assert finals == {("sync", 0): 0.3, ("sync", 1): 0.3, ("async", 0): 0.1, ("async", 1): 0.1,
                      ("half", 0): 0.6, ("half", 1): 0.6, ("fixed", 0): 0.05, ("fixed", 1): 0.05}


def test_a_language_model_tunes_on_its_validation_loss(tmp_path):
    """[tune] metric = "val_loss": the lowest mean validation loss wins, where accuracy would rank
    the two rates the other way; a run whose loss went non-finite scores nan (never chosen)."""
    from psgd.lab import experiment

    def run(name: str, evals: list[tuple[float, float]]) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "val_loss": loss, "val_accuracy": acc})
            for v, (loss, acc) in enumerate(evals)))
        return str(folder)

    slow = run("slow", [(2.9, 0.20), (2.7, 0.22), (2.6, 0.21)])      # lower loss, lower accuracy
    fast = run("fast", [(3.0, 0.20), (2.9, 0.23), (2.8, 0.22)])
    assert experiment.score(slow, 2) < experiment.score(fast, 2)      # accuracy prefers "fast"
    assert experiment.score(slow, 2, "val_loss") == pytest.approx(-2.65)
    assert experiment.score(slow, 2, "val_loss") > experiment.score(fast, 2, "val_loss")
    assert math.isnan(experiment.score(run("nan", [(2.9, 0.2), (float("nan"), 0.1)]), 2, "val_loss"))
    text = TUNED.replace("[tune]\n", '[tune]\nmetric = "val_loss"\n')
    assert suite.load_experiment(write(tmp_path, "l.toml", text), "default", tmp_path).tune_metric == "val_loss"
    with pytest.raises(suite.SuiteError, match="'tune.metric' must be one of val_accuracy, val_loss"):
        suite.load_experiment(write(tmp_path, "b.toml", TUNED.replace("[tune]\n", '[tune]\nmetric = "loss"\n')),
                              "default", tmp_path)


@pytest.mark.parametrize("extra,message", [
    ('[[runs]]\nlabel = "b"\nmode = "sync"\nlr_from = "fixed"\n', "not a tuned run"),
    ('[[runs]]\nlabel = "b"\nmode = "sync"\nlr_factor = -1.0\nlr_from = "sync"\n', "lr_factor"),
])
def test_bad_tuning_references(tmp_path, extra, message):
    with pytest.raises(suite.SuiteError, match=message):
        suite.load_experiment(write(tmp_path, "t.toml", TUNED + extra), "default", tmp_path)


def test_tuning_needs_a_validation_split(tmp_path):
    text = TUNED.replace("val_fraction = 0.25\n", "")
    with pytest.raises(suite.SuiteError, match="validation split"):
        suite.load_experiment(write(tmp_path, "t.toml", text), "default", tmp_path)


def test_one_evaluation_grid_in_samples_for_every_mode(tmp_path):
    text = ('id = "G"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n' + TINY_BASE + 'eval_samples = 64\n'
            '[[runs]]\nlabel = "sync"\nmode = "sync"\n[[runs]]\nlabel = "async"\nmode = "async"\n'
            '[[runs]]\nlabel = "k=2"\nmode = "sync"\naccumulate = 2\n')
    specs = {s.label: s.cfg for s in suite.load_experiment(write(tmp_path, "g.toml", text), "default",
                                                           tmp_path).final_specs({})}
    # sync: 2 workers x 8 = 16 samples per update; async: 8; k=2: 32. Every run evaluates each 64 samples.
    assert {k: v.eval_every for k, v in specs.items()} == {"sync": 4, "async": 8, "k=2": 2}
    with pytest.raises(suite.SuiteError, match="not a multiple"):
        suite.load_experiment(write(tmp_path, "g.toml", text.replace("eval_samples = 64", "eval_samples = 60")),
                              "default", tmp_path)


def test_the_cache_refuses_a_run_from_another_code_version(tmp_path):
    exp = suite.load_experiment(write(tmp_path, "t.toml", TUNED), "default", tmp_path, version="v1")
    spec = exp.final_specs({"sync": 0.1, "async": 0.1})[0]
    other = suite.load_experiment(write(tmp_path, "t.toml", TUNED), "default", tmp_path, version="v2")
    assert other.final_specs({"sync": 0.1, "async": 0.1})[0].cfg.out != spec.cfg.out   # the folder differs
    out = Path(spec.cfg.out)
    out.mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / "config.json").write_text(json.dumps(C.to_dict(spec.cfg)))
    (out / "provenance.json").write_text(json.dumps({"code_version": "v1"}))
    assert runcache.is_cached(spec)
    (out / "provenance.json").write_text(json.dumps({"code_version": "v0"}))   # made by other code
    assert not runcache.is_cached(spec)
    (out / "provenance.json").unlink()
    assert not runcache.is_cached(spec)


def test_a_reference_run_takes_the_default_profiles_finished_run_of_its_config(tmp_path):
    """The reference profile's first seeds are the default profile's (psgd/lab/power.py), and so are
    its tuning runs: where the default profile's folder holds a finished run of the same config and
    training code, the reference links it in instead of running it again; one by other code it does not."""
    path = write(tmp_path, "t.toml", TUNED)
    rates = {"sync": 0.1, "async": 0.1}
    made = suite.load_experiment(path, "default", tmp_path / "papers", version="v1").final_specs(rates)[0]
    spec = suite.load_experiment(path, "default", tmp_path / "papers-reference", version="v1").final_specs(rates)[0]
    assert Path(spec.cfg.out).name == Path(made.cfg.out).name and spec.cfg.out != made.cfg.out
    assert runcache.default_folder(tmp_path / "reference") == tmp_path
    assert runcache.default_folder(tmp_path / "papers") is None   # a default profile has no twin to take
    out = Path(made.cfg.out)
    out.mkdir(parents=True)
    (out / "summary.json").write_text('{"final": 1}')
    (out / "config.json").write_text(json.dumps(C.to_dict(made.cfg)))
    (out / "provenance.json").write_text(json.dumps({"code_version": "v0"}))   # made by other training code
    assert not runcache.reuse_twin(spec) and not Path(spec.cfg.out).exists()
    (out / "provenance.json").write_text(json.dumps({"code_version": "v1"}))
    assert runcache.reuse_twin(spec) and runcache.is_cached(spec)
    there = Path(spec.cfg.out)
    assert (there / "summary.json").read_text() == '{"final": 1}'
    assert json.loads((there / "config.json").read_text())["out"] == made.cfg.out   # where it was made
    assert not runcache.reuse_twin(spec)   # once linked in, it is the reference's own (cached)


def test_a_cluster_run_is_reused_only_on_the_link_it_ran_on(tmp_path, monkeypatch):
    """The config names the cluster (--hosts, --cluster), not its link: a cluster made again under the
    same name with another link must not reuse the runs of the first (psgd/lab/runcache.py is_cached)."""
    from psgd.cluster import netns, plan
    from psgd.train import hosts

    exp = suite.load_experiment(write(tmp_path, "t.toml", TUNED), "default", tmp_path, version="v1")
    spec = exp.final_specs({"sync": 0.1, "async": 0.1})[0]
    spec = dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg, hosts=2, cluster="lab"))
    up = {}
    monkeypatch.setattr(netns, "load", lambda name, state_dir=None: up.get(name))
    out = Path(spec.cfg.out)
    out.mkdir(parents=True)
    ran_on = dataclasses.replace(plan.describe("lab", 2, "1gbit,200us"), complete=True)
    (out / "summary.json").write_text(json.dumps({"cluster": {"name": "lab", **hosts.link_record(ran_on, "sync")}}))
    (out / "config.json").write_text(json.dumps(C.to_dict(spec.cfg)))
    (out / "provenance.json").write_text(json.dumps({"code_version": "v1"}))
    assert not runcache.is_cached(spec)                   # no cluster named lab is up: its link is unknown
    assert runcache.is_cached(spec, same_link=False)      # ... but the run is finished (the report reads it)
    up["lab"] = ran_on
    assert runcache.is_cached(spec)
    for other in ("200mbit,200us", "1gbit", "1gbit,1ms"):
        up["lab"] = dataclasses.replace(plan.describe("lab", 2, other), complete=True)
        assert not runcache.is_cached(spec), other
    up["lab"] = dataclasses.replace(ran_on, latency_by="netem")   # the same link, the latency by the kernel
    assert not runcache.is_cached(spec)


def test_tiny_quick_suite_tunes_runs_and_reports(tmp_path):
    # One worker per run: the suite's mechanics are under test here, and every process costs start-up
    # (a run is about 5 s of it: a server, then a worker). For the same reason only "sync" is tuned
    # end to end ("async" opts out); choosing among several tuned labels is test_tuning_plan_choice's.
    # The grid starts one step above TUNED's (0.1, 0.3): its pick sits at an end all the same (a grid of two),
    # so the sweep grows it, to an inside pick in one step (4 rates from 0.1: 3 tuning runs more, made twice).
    tuned = TUNED.replace("workers = 2", "workers = 1").replace('label = "async"\nmode = "async"\n',
                                                                'label = "async"\nmode = "async"\ntune = false\n')
    tuned = tuned.replace("lr = [0.1, 0.3]", "lr = [0.3, 0.9]")
    assert tuned.count("tune = false") == 1 and tuned.count("lr = [0.3, 0.9]") == 1
    write(tmp_path, "modes.toml", tuned.replace('id = "T"', 'id = "M"') + '[profiles.quick]\nsteps = 3\nseeds = [0]\n')
    # The wire experiment's runs are the modes experiment's sync and fp16 runs (same settings, other
    # labels): the suite makes them once.
    wire = (tuned.replace('id = "T"', 'id = "W"').replace('analysis = "modes"', 'analysis = "wire"')
            .replace('claim = "c"', 'claim = "c"\nquote = "同步"')
            .replace('[[runs]]\nlabel = "async"\nmode = "async"\ntune = false\n', "")
            .replace('[[runs]]\nlabel = "fixed"\nmode = "sync"\nlr = 0.05\n', "")
            + '[profiles.quick]\nsteps = 3\nseeds = [0]\n')
    write(tmp_path, "wire.toml", wire)
    write(tmp_path, "articles.toml", '[[articles]]\ntitle = "原题"\ntitle_en = "Title"\n[[articles.claims]]\n'
                                     'text = "A claim."\ntested_by = ["W"]\n')
    suite_file = write(tmp_path, "suite.toml", '[suite]\nexperiments = ["modes.toml", "wire.toml"]\n'
                                               'articles = "articles.toml"\n')
    results = tmp_path / "results"
    r = psgd_main("suite", str(suite_file), "--quick", "--out", str(results))   # runs: real processes
    assert r.returncode == 0, r.stderr
    report = (results / "REPORT.md").read_text()
    assert report.splitlines()[0].endswith("(SMOKE RUN: --quick)") and f"runs under `{results}/`" in report
    assert "## M" in report and "## W" in report and "> 同步" in report
    assert "## The seed articles" in report and "- A claim. Tested by [W](#w)." in report
    assert report.count("**Verdict: ") == 2
    assert "Code version: `" in report and "**Learning rates**" in report
    assert "**Setup** (from the run configs)" in report
    for fig in ("M/accuracy_vs_elapsed_s", "M/accuracy_vs_samples", "M/loss_vs_samples", "W/bytes_per_step",
                "W/accuracy"):
        assert (results / f"{fig}.png").stat().st_size > 0
        assert (results / f"{fig}.csv").read_text().count("\n") >= 2
        assert f"]({fig}.png)" in report
    commands = (results / "M" / "commands.txt").read_text()
    assert "--steps 3" in commands and "--val-fraction 0.25" in commands   # the quick profile won; tuning listed
    # Tuning: sync on 3 seeds x its grid, which grows past the end where the pick sits (at least one rate:
    # a two-rate grid's pick is always at an end); then 4 labels x 1 seed.
    n_tune = commands.count("# sync lr=")
    assert n_tune % 3 == 0 and 3 * 3 <= n_tune <= 3 * (2 + 3) and commands.count("psgd run") == n_tune + 4
    assert re.search(r"\d\+(\*\*)?(, | \|)", report) and "+: a rate the sweep added" in report   # marked
    summary = json.loads((results / "summary.json").read_text())
    assert [c["id"] for c in summary["claims"]] == ["M", "W"] and summary["code_version"]
    assert all(c["verdict"] in verdicts.OUTCOMES for c in summary["claims"])
    # fp16 moved half the bytes of fp32: the CSV behind the figure says so.
    rows = (results / "W" / "bytes_per_step.csv").read_text().splitlines()[1:]
    fp32, fp16 = (float(row.split(",")[3]) for row in rows)
    assert fp16 == pytest.approx(fp32 / 2)
    # A second call reuses every finished run, and --only still reports the whole suite.
    r = psgd_main("suite", str(suite_file), "--quick", "--results", str(results), "--only", "M")
    assert r.returncode == 0 and "cached" in r.stderr
    assert len(list((results / "runs").iterdir())) == n_tune + 4   # W made none of its own
    report = (results / "REPORT.md").read_text()
    assert "## M" in report and "## W" in report
    assert f"{n_tune + 4} of {n_tune + 4} runs reused" in report
    # --report runs nothing: the report keeps the command, date, wall time and machine of the runs it
    # reads (not its own process's: it pins no CPU kernels) and names itself beside them.
    ran = json.loads((results / "summary.json").read_text())
    r = psgd_main("suite", str(suite_file), "--quick", "--results", str(results), "--report")
    assert r.returncode == 0, r.stderr
    again = json.loads((results / "summary.json").read_text())
    kept = ("command", "date", "wall_s", "machine", "note")
    assert {k: again[k] for k in kept} == {k: ran[k] for k in kept} and "--only" in again["command"]
    assert again["reanalysed"]["command"].endswith("--report")
    assert f"- Re-analysed by `{again['reanalysed']['command']}`" in (results / "REPORT.md").read_text()
    assert [c["verdict"] for c in again["claims"]] == [c["verdict"] for c in ran["claims"]]
    # The README table is generated from summary.json.
    readme = write(tmp_path, "README.md", f"intro\n{readme_mod.README_BEGIN}\nold\n{readme_mod.README_END}\nrest\n")
    assert readme_mod.update_readme(readme, results / "summary.json")
    assert "| [M](results/REPORT.md#m)" in readme.read_text() and readme.read_text().endswith("rest\n")
    assert not readme_mod.update_readme(readme, results / "summary.json")
    # Without the runs (a fresh clone: runs are not in git) a partial call would drop what the report
    # holds. --report refuses in one line, exit 2; --only W makes W's runs (all but M's async and fixed) and keeps the
    # report and summary as they were, saying so: M's runs are still not there.
    (results / "runs").rename(tmp_path / "runs-elsewhere")
    before = {name: (results / name).read_bytes() for name in ("REPORT.md", "summary.json")}
    r = psgd_main("suite", str(suite_file), "--quick", "--results", str(results), "--report")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "reports M, W, whose finished runs by training code" in r.stderr and "--report" in r.stderr
    assert {name: (results / name).read_bytes() for name in before} == before and not (results / "runs").exists()
    r = psgd_main("suite", str(suite_file), "--quick", "--results", str(results), "--only", "W")
    assert r.returncode == 0, r.stderr
    assert r.stderr.rstrip().splitlines()[-1].startswith(f"psgd suite: kept {results / 'REPORT.md'} as it was: "
                                                         "it reports M, whose finished runs are not here")
    assert {name: (results / name).read_bytes() for name in before} == before
    assert len(list((results / "runs").iterdir())) == n_tune + 2   # W's tuning (M's sync's) and 2 evaluated runs
    assert processes_mentioning(str(results)) == []


@pytest.mark.parametrize("folder", ["results", "results/transformer", "results/papers", "results/sparse",
                                    "results/scale"])
def test_readme_verdict_table_is_current(folder):
    """docs/results.md's tables are `make readme` output from each suite's committed summary.json
    (results/summary.json, results/transformer/summary.json, ...), or from its reference profile's
    (results/reference/, results/SUITE-reference/) once it has run, as the Makefile picks."""
    reference = "results/reference" if folder == "results" else f"{folder}-reference"
    folder = reference if (ROOT / reference / "summary.json").exists() else folder
    summary = json.loads((ROOT / folder / "summary.json").read_text())
    block = readme_mod.readme_block(summary, f"{folder}/REPORT.md", f"../{folder}/REPORT.md")
    assert block in (ROOT / "docs/results.md").read_text(), "docs/results.md is stale: run `make readme`"


def test_the_run_key_is_the_last_commit_of_the_training_code():
    """The cache key names the code that trains: git's last commit of the training paths that
    changed more than comments and docstrings, read from the repository this psgd lives in (an
    empty key would let any code reuse any run)."""
    import subprocess

    from psgd.lab import provenance

    root = Path(provenance.__file__).resolve().parents[2]
    commits = subprocess.run(["git", "log", f"-{provenance.LOOK_BACK}", "--format=%h", "--", *provenance.RUN_PATHS],
                             cwd=root, capture_output=True, text=True, check=True).stdout.split()
    key = provenance.run_code_version().split("-dirty")[0]
    assert key in commits
    assert not any(provenance._changes_code(root, c) for c in commits[:commits.index(key)])
    assert provenance.code_version().split("-dirty")[0] == subprocess.run(
        ["git", "describe", "--always"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def test_a_suite_pattern_takes_the_experiment_files_of_that_suite_alone(tmp_path):
    """A new claim is its experiment file (and its analysis module): a suite's pattern finds it, in
    name order, and leaves the files another suite claims (`suite = "..."`)."""
    exp = 'id = "{id}"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n{extra}[[runs]]\nlabel = "a"\n'
    write(tmp_path, "e02_b.toml", exp.format(id="B", extra=""))
    write(tmp_path, "e01_a.toml", exp.format(id="A", extra='suite = "default"\n'))
    write(tmp_path, "e03_c.toml", exp.format(id="C", extra='suite = "other"\n'))
    default = write(tmp_path, "default.toml", '[suite]\nname = "default"\nexperiments = ["e*.toml"]\n')
    other = write(tmp_path, "other.toml", '[suite]\nname = "other"\nexperiments = ["e*.toml", "e01_a.toml"]\n')
    assert [e.id for e in suite.load_suite(default)] == ["A", "B"]
    assert [e.id for e in suite.load_suite(other)] == ["C", "A"]  # a plain entry names its file whatever it says


def test_the_analysis_registry_finds_every_analyses_module():
    from psgd.lab import analyses

    table = analyses.registry()
    # One name of each module (psgd/lab/analyses*.py): none is listed by hand.
    for name in ("modes", "batch", "link", "backup_workers", "elastic", "adam_staleness"):
        assert name in table
    assert all(callable(fn) for fn in table.values())
    # The two suites' claims all find their analysis.
    for name in ("default.toml", "transformer.toml"):
        for e in suite.load_suite(ROOT / "experiments" / name):
            assert e.analysis in table, e.path


def test_the_papers_suite_shares_the_default_suites_base_and_profiles():
    """experiments/papers.toml copies the default suite's [base] and profiles, so the runs the two share
    (E19's rates are E1's, E20's runs E2's configs, E23's E6's) are the same configurations."""
    import tomllib

    default, papers = (tomllib.loads((ROOT / "experiments" / f"{n}.toml").read_text()) for n in ("default", "papers"))
    assert papers["base"] == default["base"] and papers.get("profiles") == default.get("profiles")
    ids = {n: {e.id for e in suite.load_suite(ROOT / "experiments" / f"{n}.toml")} for n in ("default", "papers")}
    assert ids["papers"] == {"E19", "E20", "E21", "E23"} and not ids["papers"] & ids["default"]


def test_a_suite_that_cannot_be_analysed_is_refused_before_any_run(tmp_path):
    """Issue 54, item 12: a pattern matching no experiment file, and an analysis whose [params] name a
    run the experiment lacks, are one-line usage errors (exit 2) before any folder or run exists,
    not a traceback once the runs have finished."""
    results = tmp_path / "results"
    empty = write(tmp_path, "empty.toml", '[suite]\nexperiments = ["zz*.toml"]\n')
    r = psgd_main("suite", str(empty), "--out", str(results))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "pattern 'zz*.toml' matches no experiment file of suite 'default'" in r.stderr
    exp = ('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "batch"\n'
           '[params]\nsmall = "b8"\nfixed = "b16"\ntuned = "b16 tuned"\n' + TINY_BASE
           + 'lr = 0.1\n[[runs]]\nlabel = "b8"\n[[runs]]\nlabel = "b16"\nbatch_size = 16\n')
    write(tmp_path, "e1.toml", exp)
    suite_file = write(tmp_path, "suite.toml", '[suite]\nexperiments = ["e*.toml"]\n')
    r = psgd_main("suite", str(suite_file), "--out", str(results))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "[params] tuned names a run labelled 'b16 tuned', which the experiment does not have" in r.stderr
    assert not results.exists()
    write(tmp_path, "e1.toml", exp.replace('tuned = "b16 tuned"\n', ""))
    assert "[params] needs 'tuned'" in psgd_main("suite", str(suite_file), "--out", str(results)).stderr
    # Where it can only fail once the runs are there, the failure is still one line naming the claim.
    def broken(*_):
        raise ValueError("e1.toml: no run reached the target")
    with pytest.raises(suite.SuiteError, match=r"^X: analysis 'batch' could not read its runs: e1.toml: no run"):
        suite._analysed(type("A", (), {"analyse": staticmethod(broken)}), suite.load_suite(suite_file)[0])


def test_the_progress_bar_counts_to_its_total(tmp_path, monkeypatch):
    """Issue 54, item 5: the quick suite's bar said 108 and counted to 110 (a grid grown past its end
    adds runs the plan did not count); it is set again before each experiment and grows with a run
    it did not expect, so it never counts past its total."""
    import io

    from tqdm import tqdm

    from psgd.lab import runner as runner_mod

    seen = []
    monkeypatch.setattr(runner_mod, "execute", lambda spec, fresh, position, tb=None: seen.append(position) or {})
    monkeypatch.setattr(runner_mod, "is_cached", lambda spec: False)
    monkeypatch.setattr(runner_mod, "twin", lambda spec: None)
    bar = tqdm(total=2, file=io.StringIO())
    r = runner_mod.Runner(bar, False, None)
    specs = [SimpleSpec(f"run{i}") for i in range(3)]
    r.run_all(specs[:2] + specs[:1])   # a run met twice is one step
    r.run_all(specs[2:])
    assert seen == ["[1/2]", "[2/2]", "[2/2]", "[3/3]"]   # the run met again is the step it was
    assert (bar.n, bar.total) == (3, 3)
    r.expect(0)
    assert bar.total == 3
    exp = suite.load_experiment(write(tmp_path, "t.toml", TUNED), "default", tmp_path, version="v1")
    planned = {s.cfg.out for s in (*exp.tune_specs(), *exp.planned_specs())}
    assert suite._steps([exp], set()) == len(planned) and suite._steps([exp, exp], set(list(planned)[:1])) == \
        len(planned) - 1


class SimpleSpec:
    def __init__(self, out: str) -> None:
        self.cfg = type("Cfg", (), {"out": out})()


def test_a_suite_is_named_or_listed_and_an_unknown_one_is_one_line(tmp_path):
    """Issue 54, item 9: `psgd suite default` is experiments/default.toml (an installed psgd carries
    it as psgd/experiments/, tests/test_packaging.py); `psgd suite --list` names every suite."""
    from psgd.lab import suites

    assert suites.resolve("default") == ROOT / "experiments" / "default.toml"
    assert suites.resolve(str(ROOT / "experiments" / "papers.toml")) == ROOT / "experiments" / "papers.toml"
    shipped = {"default", "papers", "transformer", "scale"} | (
        {"sparse"} if (ROOT / "experiments" / "sparse.toml").exists() else set())
    assert set(suites.available()) == shipped  # not an experiment or articles file
    r = psgd_main("suite", "--list")
    assert r.returncode == 0 and [line.split()[0] for line in r.stdout.splitlines()] == sorted(shipped)
    r = psgd_main("suite", "nope", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and ", ".join(sorted(shipped)) in r.stderr
    r = psgd_main("suite", "default", "--report", "--out", str(tmp_path / "r"))   # nothing ran there: one line
    assert r.returncode == 2 and "has none of this suite's" in r.stderr and not (tmp_path / "r").exists()


def test_report_keeps_the_invocation_that_made_the_runs_only_when_its_runs_are_these(tmp_path):
    # A --report keeps the summary of the invocation that made the folder's runs; one left by an
    # invocation whose runs were since made again by other training code says nothing of these.
    made = {"command": "psgd suite x.toml", "date": "2026-12-05 15:59 UTC", "wall_s": 509.4, "machine": "m",
            "profile": "default", "run_code_version": "aaaaaaa"}
    (tmp_path / "summary.json").write_text(json.dumps(made))
    assert suite._made_as(tmp_path, "default", "aaaaaaa") == made
    assert suite._made_as(tmp_path, "default", "bbbbbbb") is None
    assert suite._made_as(tmp_path, "reference", "aaaaaaa") is None


def test_a_report_names_the_kernels_its_runs_used_not_its_own(tmp_path):
    # A re-analysis (--report) pins no kernels of its own; its machine line is the runs' (provenance.json).
    from types import SimpleNamespace

    from psgd.lab import report

    runs = []
    for k, kernels in enumerate(("avx2", "avx2", None)):
        folder = tmp_path / f"r{k}"
        folder.mkdir()
        (folder / "provenance.json").write_text(json.dumps({"cpu_kernels": kernels} if kernels else {}))
        runs.append((SimpleNamespace(cfg=SimpleNamespace(out=str(folder))), {}))
    pending = [(None, runs, None, None, None), (None, [(SimpleNamespace(cfg=SimpleNamespace(out="nowhere")), {})],)]
    assert suite._kernels_of(pending) == "avx2"
    assert suite._kernels_of([]) is None
    assert ", CPU kernels avx2, " in report.machine("avx2") and ", CPU kernels zz, " in report.machine("zz")
