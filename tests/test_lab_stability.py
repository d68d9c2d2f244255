"""Issue 34 on made-up runs: split-half stability, the power rule's seeds in the report and the
reference profile, and best-validation scoring."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from psgd.core.config import OptimConfig, RunConfig, to_dict
from psgd.lab import analyses, experiment, loader, power, readme, report, results, stats

ROOT = Path(__file__).resolve().parent.parent


def runs(root: Path, label: str, acc: list[float], mode: str, workers: int, optimizer: str,
         val: list[list[float]] | None = None, test: list[list[float]] | None = None) -> list:
    """(spec, summary) pairs, one per seed: six evaluations ending at acc[seed] (or the given
    per-evaluation test and validation accuracies)."""
    out = []
    for seed, a in enumerate(acc):
        folder = root / f"{label.replace(' ', '_').replace(',', '')}-{seed}"
        folder.mkdir(parents=True)
        cfg = to_dict(RunConfig(mode=mode, seed=seed, workers=workers, optim=OptimConfig(optimizer=optimizer)))
        (folder / "summary.json").write_text(json.dumps({"mode": mode, "config": cfg, "staleness": {"mean": 3.0}}))
        evals = [{"event": "eval", "version": v, "samples": 100 * v,
                  "test_accuracy": test[seed][v] if test else a,
                  **({"val_accuracy": val[seed][v]} if val else {})} for v in range(6)]
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in evals))
        out.append((SimpleNamespace(label=label, seed=seed, cfg=SimpleNamespace(out=str(folder))), {}))
    return out


def e16(tmp_path: Path, adam_async: list[float]):
    n = len(adam_async)
    summaries = (runs(tmp_path, "one worker", [0.62] * n, "sync", 1, "sgd")
                 + runs(tmp_path, "async", [0.60] * n, "async", 4, "sgd")
                 + runs(tmp_path, "one worker, AdamW", [0.62] * n, "sync", 1, "adamw")
                 + runs(tmp_path, "async, AdamW", adam_async, "async", 4, "adamw"))
    exp = SimpleNamespace(id="E16", path="e16.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="adam_staleness", seeds=tuple(range(n)), margin_why="two points matter.",
                          params={"sgd": ["one worker", "async"], "adamw": ["one worker, AdamW", "async, AdamW"],
                                  "margin": 0.02})
    (tmp_path / "E16").mkdir()
    return analyses.analyse(exp, summaries, tmp_path / "E16")


def test_halves_split_in_seed_order_and_an_odd_count_leaves_the_middle_seed_out():
    assert analyses.halves_of([3, 0, 1, 2]) == ([0, 1], [2, 3], [])
    assert analyses.halves_of([0, 1, 2, 3, 4]) == ([0, 1], [3, 4], [2])
    assert analyses.halves_of([0, 1, 2]) == ([0], [2], [1])
    assert analyses.halves_of([7]) == ([], [], [7])


def test_halves_of_fewer_than_four_seeds_each_are_not_judged(tmp_path):
    """Issue 57: halves of 1-3 seeds give intervals too wide to check anything (and before it a
    one-seed half decided on a zero-width interval); they are not judged. The rule before judged any
    split with a seed in each half."""
    section = e16(tmp_path, [0.51, 0.50, 0.51, 0.50, 0.51, 0.50, 0.51])   # halves of 3
    assert section.verdict == "confirmed" and section.halves is None


def test_a_claim_whose_halves_agree_is_stable(tmp_path):
    section = e16(tmp_path, [0.51, 0.50, 0.51, 0.50, 0.51, 0.50, 0.51, 0.50, 0.51])   # ~9 points more in every seed
    h = section.halves
    assert section.verdict == "confirmed" and h["first"]["verdict"] == h["second"]["verdict"] == "confirmed"
    assert h["first"]["seeds"] == [0, 1, 2, 3] and h["second"]["seeds"] == [5, 6, 7, 8] and h["left_out"] == [4]
    assert not h["unstable"]
    text = report.write(tmp_path, [section], command="c", wall_s=1.0).read_text()
    assert "unstable" not in text.split("## E16")[0].split("| claim | verdict |")[1].split("##")[0]
    assert "seed 4 left out of both" in text
    claim = json.loads((tmp_path / "summary.json").read_text())["claims"][0]
    assert claim["stability"] == "stable" and claim["split_half"]["first"]["verdict"] == "confirmed"


def test_a_claim_whose_halves_contradict_each_other_is_unstable(tmp_path):
    # Seeds 0-3: AdamW loses 9 points more than SGD (confirmed); seeds 5-8: 3 points less
    # (refuted). All nine together straddle the margin.
    section = e16(tmp_path, [0.51, 0.52, 0.51, 0.52, 0.55, 0.63, 0.64, 0.63, 0.64])
    h = section.halves
    assert (h["first"]["verdict"], h["second"]["verdict"]) == ("confirmed", "refuted") and h["unstable"]
    assert section.verdict == "inconclusive"
    text = report.write(tmp_path, [section], command="c", wall_s=1.0).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| [E16](#e16)") and "inconclusive" in line)
    assert "**inconclusive**, unstable (seeds 0, 1, 2, 3: confirmed; seeds 5, 6, 7, 8: refuted)" in row
    assert "**Split halves**" in text and "**unstable**: one half confirms what the other refutes" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["claims"][0]["stability"] == "unstable" and summary["claims"][0]["split_half"]["unstable"]
    # The README's table, made from summary.json, marks it too; an older summary without the field renders as before.
    assert "unstable (seeds 0, 1, 2, 3: confirmed; seeds 5, 6, 7, 8: refuted)" in readme.readme_block(summary)
    old = {**summary, "claims": [{k: v for k, v in summary["claims"][0].items() if k in ("id", "title", "verdict",
                                                                                          "headline", "key")}]}
    assert "unstable" not in readme.readme_block(old)


def test_the_report_states_seeds_run_seeds_asked_and_whether_three_decide(tmp_path):
    section = e16(tmp_path, [0.51, 0.50, 0.51, 0.50, 0.51])
    pw = section.power
    part = section.effects[0]   # AdamW's cost minus SGD's; the second, AdamW's own cost above 0, has no margin to size
    assert pw["seeds_run"] == 5 and pw["replicates"] == "seeds" and pw["margin_why"] == "two points matter."
    assert pw["seeds_asked"] == max(stats.POWER_FLOOR, stats.seeds_for_margin(part.ci, part.margin, least=2))
    assert pw["three_decide"] is (stats.half_width(stats.spread_of(part.ci), 3) <= part.margin / 2)
    text = report.write(tmp_path, [section], command="c", wall_s=1.0).read_text()
    assert "**Seeds.** Ran 5 seeds; the power rule" in text and f"asks for {pw['seeds_asked']} (" in text
    assert "3 seeds cannot decide it" in text and "Smallest effect of interest: two points matter." in text
    assert "## Seeds: run and asked" in text and "| [E16](#e16) | 5 | 8 | no |  | end of budget |" in text


def test_three_seeds_decide_a_tight_claim_and_a_benchmark_has_no_floor():
    tight = stats.mean_ci([0.100, 0.101, 0.099])
    p = power.claim_power([SimpleNamespace(label="x", ci=tight, margin=0.02)])
    assert p["three_decide"] and p["seeds_asked"] == stats.POWER_FLOOR
    b = power.claim_power([SimpleNamespace(label="x", ci=tight, margin=0.02)], bench=True)
    assert b["seeds_asked"] == 2 and b["replicates"] == "benchmark rounds"
    unsized = power.claim_power([SimpleNamespace(label="share", ci=tight, margin=0.0)])
    assert unsized["seeds_asked"] is None and unsized["unsized"] == ["share"] and "not sized: share" in \
        power.sentence(unsized)


def test_the_reference_plan_caps_every_claim_at_the_largest_count_that_fits():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class E:
        id: str
        seeds: tuple = (0, 1, 2)
        bench: str = ""

    exps = [E("A"), E("B"), E("C"), E("D", (), "cluster")]

    def eta(es):   # one minute per seed
        return 60.0 * sum(len(e.seeds) for e in es)

    seeds, cap, took = power.reference_plan(exps, {"A": 8, "B": 40, "C": 12}, cap_s=50 * 60, estimate=eta)
    assert cap == 30 and seeds == {"A": 8, "B": 30, "C": 12} and took == 60 * 50   # D, a benchmark: no seeds
    seeds, cap, _ = power.reference_plan(exps, {"A": 8, "B": 9}, cap_s=60 * 60, estimate=eta)
    assert cap is None and seeds == {"A": 8, "B": 9}


def test_a_benchmarks_reference_rounds_are_the_rule_raised_to_the_seeds_floor(tmp_path, capsys):
    assert power.reference_rounds(4) == stats.POWER_FLOOR and power.reference_rounds(13) == 13
    # The plan command, from a forest.csv whose E4 parts ask 4 and 2 rounds: one line for E4, in rounds.
    forest = tmp_path / "forest.csv"
    forest.write_text("claim,verdict,effect,unit,test,estimate,lo,hi,seeds,null,margin,part_outcome\n"
                      "E4,confirmed,gloo speedup - PS,x,effect,0.2145,0.1531,0.2760,3,0.0,0.2,confirmed\n"
                      "E4,confirmed,ring speedup - PS,x,effect,0.8045,0.6943,0.9146,3,0.0,0.2,confirmed\n")
    from psgd.lab import reference
    assert reference.asked_from_forest(forest, ["E4"]) == {"E4": 4}
    assert reference.main(["plan", str(ROOT / "experiments" / "default.toml"), str(forest)]) == 0
    out = capsys.readouterr().out
    assert f"E4: rule asks 4 rounds, reference {stats.POWER_FLOOR} rounds" in out and "E0:" not in out


def rounds(argv: tuple[str, ...]) -> int:
    """A benchmark's --rounds (1 where it does not say; 0 for a learning claim: no argv)."""
    return int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else int(bool(argv))


def without_rounds(argv: tuple[str, ...]) -> tuple[str, ...]:
    i = argv.index("--rounds") if "--rounds" in argv else len(argv)
    return argv[:i] + argv[i + 2:]


@pytest.mark.parametrize("name", ["default.toml", "transformer.toml", "papers.toml"])
def test_every_claim_says_why_its_margin_and_the_reference_profile_only_adds_seeds(name):
    default = loader.load_suite(ROOT / "experiments" / name, "default", results=Path("/nonexistent"))
    reference = loader.load_suite(ROOT / "experiments" / name, "reference", results=Path("/nonexistent"))
    quick = loader.load_suite(ROOT / "experiments" / name, "quick", results=Path("/nonexistent"))
    for d, r in zip(default, reference, strict=True):
        assert d.margin_why, f"{d.path}: margin_why"
        # Issue 57: the margin is fixed in the file, the same at every profile (E5's factor is a threshold).
        assert d.margins or d.id == "E5", f"{d.path}: [margin]"
        assert r.margins == d.margins == next(q for q in quick if q.id == d.id).margins
        assert r.seeds[:len(d.seeds)] == d.seeds and (len(r.seeds) >= 8 or r.seeds == d.seeds)
        assert r.templates == d.templates and r.tune_seeds == d.tune_seeds
        # A benchmark's replicates are its rounds: the reference may add rounds, and change nothing else.
        assert without_rounds(r.bench_args) == without_rounds(d.bench_args)
        assert rounds(r.bench_args) >= rounds(d.bench_args)
        assert d.scoring in ("end", "best_val")


# -- best-validation scoring ----------------------------------------------------------------------
def test_a_run_is_scored_at_its_best_validation_point_or_at_the_end(tmp_path):
    val = [[0.5, 0.6, 0.7, 0.65, 0.6, 0.6], [0.5, 0.8, 0.8, 0.7, 0.7, 0.7]]
    test = [[0.4, 0.5, 0.68, 0.6, 0.55, 0.5], [0.4, 0.75, 0.9, 0.6, 0.6, 0.6]]
    pairs = runs(tmp_path, "sync", [0, 0], "sync", 1, "sgd", val=val, test=test)
    loaded = [results.load_run(s.cfg.out) for s, _ in pairs]
    assert [results.best_val_index(r) for r in loaded] == [2, 1]         # ties: the earliest
    end = results.Group("sync", loaded)
    best = results.Group("sync", loaded, scoring="best_val")
    assert end.finals() == pytest.approx([0.55, 0.6]) and best.finals() == pytest.approx([0.68, 0.75])
    assert results.Group("sync", loaded, "best_val", "val_loss").scoring == "best_val"
    bare = [results.load_run(s.cfg.out) for s, _ in runs(tmp_path / "bare", "sync", [0.6], "sync", 1, "sgd")]
    with pytest.raises(ValueError, match="no finite val_accuracy.*--val-fraction"):
        results.Group("x", bare, scoring="best_val").finals()


def test_best_validation_scoring_can_change_the_verdict_and_the_report_says_which(tmp_path):
    """AdamW's async arm peaks at its best validation point as high as SGD's and decays after it:
    scored at the end AdamW loses clearly more to staleness, at the best validation point no more."""
    n = 3
    flat = [[0.6] * 6 for _ in range(n)]
    peak = [[0.5, 0.6, 0.62, 0.55, 0.5, 0.5] for _ in range(n)]      # validation peaks at evaluation 2
    test_peak = [[0.5, 0.58, 0.60 + 0.001 * s, 0.52, 0.45, 0.45 + 0.001 * s] for s in range(n)]
    control = [[0.62 + 0.001 * s] * 6 for s in range(n)]
    sgd_async = [[0.60 + 0.001 * s] * 6 for s in range(n)]

    def arms(root: Path, scoring: str):
        summaries = (runs(root, "one worker", [0] * n, "sync", 1, "sgd", flat, control)
                     + runs(root, "async", [0] * n, "async", 4, "sgd", flat, sgd_async)
                     + runs(root, "one worker, AdamW", [0] * n, "sync", 1, "adamw", flat, control)
                     + runs(root, "async, AdamW", [0] * n, "async", 4, "adamw", peak, test_peak))
        exp = SimpleNamespace(id="E16", path="e16.toml", title="t", claim="c", quote="", quote_en="",
                              quote_source="", why="w", analysis="adam_staleness", seeds=(0, 1, 2),
                              scoring=scoring, tune_metric="val_accuracy",
                              params={"sgd": ["one worker", "async"], "adamw": ["one worker, AdamW", "async, AdamW"],
                                      "margin": 0.02})
        (root / "E16").mkdir(parents=True)
        return analyses.analyse(exp, summaries, root / "E16")

    end, best = arms(tmp_path / "end", "end"), arms(tmp_path / "best", "best_val")
    # Issue 57: every claim is read at both scorings, and where they differ the verdict says so.
    assert (end.verdict, best.verdict) == ("depends", "depends"), (end.headline, best.headline)
    for s in (end, best):
        assert "confirmed at the end of the budget" in s.body and "refuted at the best validation point" in s.body
    assert "depends on scoring: confirmed at the end of the budget" in end.body
    assert "depends on scoring: refuted at the best validation point" in best.body
    assert "scored at the end of the budget" in end.body and "scored at the best validation point" in best.body
    assert best.scoring == "best_val"
    text = report.write(tmp_path, [best], command="c", wall_s=1.0).read_text()
    assert "**Scored** at each run's best validation point" in text
    assert json.loads((tmp_path / "summary.json").read_text())["claims"][0]["scoring"] == "best_val"


@pytest.mark.parametrize("extra, message", [
    ('scoring = "best"', "must be one of end, best_val"),
    ('scoring = "best_val"', "has no validation split"),
    ("margin_why = 3", "'margin_why' must be a string"),
    ("margin = { accuracy = 0 }", r"\[margin\] accuracy must be a positive number"),
    ("margin = { acc = 0.01 }", "unknown key 'acc' in \\[margin\\]"),
    ("margin = 0.01", r"\[margin\] must be a table"),
    ('margin = { accuracy = 0.01 }\n[profiles.quick]\nmargin = { accuracy = 0.05 }',
     "profiles.quick.*unknown key 'margin'"),
])
def test_bad_scoring_and_margin_why_name_file_and_key(tmp_path, extra, message):
    path = tmp_path / "e.toml"
    path.write_text(f'id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n{extra}\n'
                    '[base]\ndataset = "synthetic"\nnum_samples = 400\nmodel = "logreg"\nsteps = 4\n'
                    '[[runs]]\nlabel = "sync"\nmode = "sync"\n')
    with pytest.raises(experiment.SuiteError, match=message):
        loader.load_experiment(path, "quick", tmp_path)


def test_best_val_loads_where_every_run_has_a_validation_split(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text('id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\nscoring = "best_val"\n'
                    'margin_why = "a point"\n[base]\ndataset = "synthetic"\nnum_samples = 400\nmodel = "logreg"\n'
                    'steps = 4\nval_fraction = 0.2\n[[runs]]\nlabel = "sync"\nmode = "sync"\n')
    exp = loader.load_experiment(path, "default", tmp_path)
    assert exp.scoring == "best_val" and exp.margin_why == "a point"


def test_a_shorter_budget_is_read_off_the_same_runs(tmp_path):
    """E1's budget factor: up_to keeps the evaluations made by then, so the finals are the mean of the
    last three of those (a constant rate: the state there is a shorter run's final state)."""
    val = [[0.5, 0.6, 0.7, 0.65, 0.6, 0.6]]
    test = [[0.4, 0.5, 0.68, 0.6, 0.55, 0.5]]
    loaded = [results.load_run(s.cfg.out) for s, _ in runs(tmp_path, "sync", [0], "sync", 1, "sgd", val=val,
                                                             test=test)]
    g = results.Group("sync", loaded)
    samples = [e["samples"] for e in loaded[0].evals]
    short = results.up_to(g, samples[3])
    assert [e["samples"] for e in short.runs[0].evals] == samples[:4]
    assert short.finals() == pytest.approx([(0.5 + 0.68 + 0.6) / 3]) and g.finals() == pytest.approx([0.55])


def test_the_eta_sizes_each_dataset_once_however_many_runs_and_etas_ask(monkeypatch):
    """The reference plan asks for a dozen ETAs of hundreds of runs; the transformer's text was loaded
    again for each run of each (minutes for `python -m psgd.lab.reference plan experiments/transformer.toml`)."""
    from types import SimpleNamespace

    from psgd.core.config import RunConfig
    from psgd.lab import runner
    from psgd.train import data

    calls = []
    monkeypatch.setattr(data, "train_size", lambda cfg: calls.append(cfg) or 1000)
    monkeypatch.setattr(runner, "_SIZES", {})
    specs = [SimpleNamespace(cfg=RunConfig(seed=s, out=f"r{s}", epochs=1.0)) for s in range(20)]
    exp = SimpleNamespace(bench="", tune_specs=lambda: specs[:10], planned_specs=lambda: specs[10:])
    first = runner.estimate_s([exp], fresh=True)
    assert runner.estimate_s([exp], fresh=True) == first > 0
    assert len(calls) == 1   # one data config among the 20 runs, sized once for both ETAs
