"""REPORT.md's seed material: each quote with its English translation, and "The seed articles"
(titles and an English summary of their claims, from experiments/seed_articles.toml). Fast: the
report is written from hand-made sections, no run is made."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from psgd.lab import analyses_remedies, analysis_kit, readme, report, seeds_table, stats, suite
from psgd.lab import articles as articles_mod
from psgd.lab import verdicts as V
from psgd.lab.results import Section

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "experiments" / "default.toml"
CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")


def default_ids() -> list[str]:
    return [e.id for e in suite.load_suite(SUITE, "default")]


def remedies() -> set[str]:
    """The remedies' experiments (psgd/lab/analyses_remedies.py): measured answers to the seeds'
    problems, citing their papers in the claim; no seed article's claim, so no seed quote."""
    return {e.id for e in suite.load_suite(SUITE, "default") if e.analysis in analyses_remedies.ANALYSES}


def section(exp_id: str, quote: str = "", quote_en: str = "", source: str = "") -> Section:
    return Section(exp_id, f"title of {exp_id}", f"claim of {exp_id}", quote, "confirmed", "key number",
                   "body text", quote_en=quote_en, quote_source=source)


def test_seed_articles_name_only_experiments_of_the_suite():
    ids = default_ids()
    arts = articles_mod.suite_articles(SUITE, ids)   # raises on an id the suite lacks
    assert len(arts) == 2
    for a in arts:
        assert a.title and a.title_en and not CJK.search(a.title_en)
        assert 4 <= len(a.claims) <= 10
        for c in a.claims:
            assert not CJK.search(c.text)
            assert bool(c.tested_by) != bool(c.not_tested)
            assert set(c.tested_by) <= set(ids)
    named = {i for a in arts for c in a.claims for i in c.tested_by}
    # Every seed claim the suite measures is listed (E0 is a paper's, the remedies are the field's,
    # and so is an experiment whose quote comes from a paper, not a seed article: E14, DiLoCo's, or
    # that tests a paper's claim on its own terms and cites it in the claim: E19-E23).
    papers = {e.id for e in suite.load_suite(SUITE, "default")
              if (e.quote_source and not e.quote_source.isdigit()) or not e.quote}
    assert named == set(ids) - {"E0"} - remedies() - papers


def test_every_chinese_quote_has_an_english_translation():
    experiments = suite.load_suite(SUITE, "default")
    quoted = [e for e in experiments if CJK.search(e.quote)]
    assert len(quoted) >= 10
    for e in quoted:
        assert e.quote_en and not CJK.search(e.quote_en), f"{e.id}: quote_en missing or not English"
    assert all(not e.quote_en for e in experiments if e.quote and not CJK.search(e.quote))


def test_every_quote_names_its_source_and_a_seed_source_is_an_article():
    # Whether the words are the article's is tools/check_quotes.py's (the seed texts are not in the repo).
    experiments = suite.load_suite(SUITE, "default")
    article_ids = {a.id for a in articles_mod.suite_articles(SUITE)}
    assert article_ids == {"000", "003"}
    remedy_ids = remedies()
    for e in experiments:
        if e.id in remedy_ids:
            assert not e.quote, f"{e.id}: a remedy quotes no seed article (its claim cites its papers)"
            continue
        if not e.quote:   # a paper's claim on its own terms: the claim names the paper it tests
            assert re.search(r"et al\. \d{4}", e.claim), f"{e.id}: no quote, and the claim cites no paper"
            continue
        assert e.quote and e.quote_source, f"{e.id}: a quote and where it is from"
        if CJK.search(e.quote):
            assert e.quote_source in article_ids, f"{e.id}: quote_source {e.quote_source!r} is not a seed article"


def test_report_prints_the_english_quote_and_the_seed_articles(tmp_path):
    arts = articles_mod.load_articles(ROOT / "experiments" / "seed_articles.toml")
    sections = [section("E1", "同步更新收敛稳定。", "Synchronous updates converge stably.", "003"),
                section("E0", "An English quote.", source="Someone 2020, Table 1"),
                section("E2", "一句话。", "One sentence.")]
    path = report.write(tmp_path, sections, command="psgd suite x.toml", wall_s=1.0, version="v1", articles=arts)
    text = path.read_text()
    # The original as a blockquote, the labelled English right under it (a quote in English has none).
    # Where the words are from follows them: a seed article by its number, another source as given.
    assert "> 同步更新收敛稳定。 — seed article 003\n>\n> *English:* Synchronous updates converge stably.\n" in text
    assert "> An English quote. — Someone 2020, Table 1\n\n**Claim.**" in text
    assert "> 一句话。\n>\n> *English:* One sentence.\n" in text
    # The articles, once, between the verdict table and the first claim.
    assert text.count("## The seed articles") == 1
    assert text.index("| claim | verdict |") < text.index("## The seed articles") < text.index("## E1")
    for a in arts:
        assert f"### Seed article {a.id}: {a.title}\n\n*{a.title_en}*\n" in text
        assert all(c.text in text for c in a.claims)
    assert "Tested by [E1](#e1)" in text              # a section of this report: linked
    assert "Tested by E5." in text                     # not in this report: the bare id
    assert "Not tested here: " in text
    # Without articles, no such section.
    text = report.write(tmp_path, sections, command="c", wall_s=1.0).read_text()
    assert "The seed articles" not in text


@pytest.mark.parametrize("text,message", [
    ('[[articles]]\ntitle_en = "t"\n[[articles.claims]]\ntext = "c"\ntested_by = ["E1"]\n', "'title' is required"),
    ('[[articles]]\ntitle = "t"\ntitle_en = "t"\n', "at least one [[articles.claims]]"),
    ('[[articles]]\ntitle = "t"\ntitle_en = "t"\n[[articles.claims]]\ntext = "c"\n', "exactly one of"),
    ('[[articles]]\ntitle = "t"\ntitle_en = "t"\n[[articles.claims]]\ntext = "c"\ntested_by = ["E1"]\n'
     'not_tested = "n"\n', "exactly one of"),
    ('[[articles]]\ntitle = "t"\ntitle_en = "t"\n[[articles.claims]]\ntext = "c"\ntested_by = ["E99"]\n',
     "names 'E99', which is not an experiment"),
    ('[[articles]]\ntitle = "t"\ntitle_en = "t"\n[[articles.claims]]\ntext = "c"\ntested_by = []\n',
     "non-empty list"),
    ('[[articles]]\ntitle = "t"\ntitle_en = "t"\nbogus = 1\n[[articles.claims]]\ntext = "c"\nnot_tested = "n"\n',
     "unknown key 'bogus'"),
    ('[[articles]]\nid = 0\ntitle = "t"\ntitle_en = "t"\n[[articles.claims]]\ntext = "c"\nnot_tested = "n"\n',
     "key 'id' must be a non-empty string"),
    ('[[articles]\n', "not valid TOML"),
])
def test_bad_articles_files_name_file_and_key(tmp_path, text, message):
    path = tmp_path / "articles.toml"
    path.write_text(text)
    (tmp_path / "suite.toml").write_text('[suite]\nexperiments = []\narticles = "articles.toml"\n')
    with pytest.raises(suite.SuiteError, match=re.escape(message)) as e:
        articles_mod.suite_articles(tmp_path / "suite.toml", ["E1", "E2"])
    assert str(path) in str(e.value)


def test_a_suite_without_articles_has_none(tmp_path):
    (tmp_path / "suite.toml").write_text('[suite]\nexperiments = ["a.toml"]\n')
    assert articles_mod.suite_articles(tmp_path / "suite.toml", ["E1"]) == ()


@pytest.mark.parametrize("extra,message", [
    ('quote_en = "English"\n', "'quote_en' translates 'quote', which is missing"),
    ('quote = "原文"\nquote_en = 3\n', "key 'quote_en' must be a string"),
    ('quote_source = "000"\n', "'quote_source' says where 'quote' is from, which is missing"),
    ('quote = "原文"\nquote_source = 0\n', "key 'quote_source' must be a string"),
])
def test_quote_en_and_quote_source_need_a_quote_and_a_string(tmp_path, extra, message):
    path = tmp_path / "x.toml"
    path.write_text(f'id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n{extra}[[runs]]\nlabel = "a"\n')
    with pytest.raises(suite.SuiteError, match=re.escape(message)):
        suite.load_experiment(path, "default", tmp_path)


# -- one code version ----------------------------------------------------------------------------
RESULTS = ROOT / "results"
VERSION_LINE = re.compile(r"every run below was made by training code `([^`]+)`")


def test_the_committed_report_states_the_one_training_code_version_of_every_run_it_cites():
    """The reference report (results/REPORT.md) names one training-code version, and it is the one
    that made everything it cites: summary.json's, every cited experiment's commands.txt header
    (written when its runs or benchmark ran), and, where the cited run folders are here (results/runs
    is not committed; a checkout that ran the suite has them), each run's own provenance.json. It
    asks nothing of what else a user ran into results/runs (README sends a first run there)."""
    summary = json.loads((RESULTS / "summary.json").read_text())
    stated = VERSION_LINE.search((RESULTS / "REPORT.md").read_text())
    assert stated, "REPORT.md names no single training-code version for its runs"
    version = stated.group(1)
    assert summary["run_code_version"] == version
    assert summary.get("run_code_versions", [version]) == [version]
    for claim in summary["claims"]:
        commands = (RESULTS / claim["id"] / "commands.txt").read_text()
        header = re.search(r"^# code version: (\S+)$", commands, re.M)
        assert header and header.group(1) == version, \
            f"{claim['id']}: commands.txt says training code {header and header.group(1)}, REPORT.md says {version}"
        for out in re.findall(r"--out (results/runs/[0-9a-f]+)", commands):
            made = ROOT / out / "provenance.json"
            if made.exists():
                assert json.loads(made.read_text())["code_version"] == version, f"{claim['id']}: {out}"


def test_a_report_from_runs_of_two_training_codes_says_so(tmp_path):
    sections = [section("E1"), section("E2")]
    text = report.write(tmp_path, sections, command="c", wall_s=1.0, version="abc1234", run_version="abc1234",
                        made_by={"E1": {"abc1234"}, "E2": {"abc1234"}}).read_text()
    assert "every run below was made by training code `abc1234`" in text
    mixed = report.write(tmp_path, sections, command="c", wall_s=1.0, version="abc1234", run_version="abc1234",
                         made_by={"E1": {"abc1234"}, "E2": {"0ld0000", "abc1234"}})
    text = mixed.read_text()
    assert not VERSION_LINE.search(text)
    assert "more than one version of the training code**: `0ld0000` (E2); `abc1234` (E1, E2)" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run_code_versions"] == ["0ld0000", "abc1234"]
    assert summary["run_code_version"] == "mixed: 0ld0000, abc1234"


def test_made_by_reads_each_runs_provenance_and_a_benchmarks_commands(tmp_path):
    exp = suite.load_suite(SUITE, "default", results=tmp_path, version="now1234")
    learning = next(e for e in exp if not e.bench)
    bench = next(e for e in exp if e.bench)
    finals = learning.final_specs({t.label: t.lr_grid[0] for t in learning.templates if t.lr_grid})[:2]
    for spec, v in zip(finals, ("old0001", "now1234"), strict=True):
        Path(spec.cfg.out).mkdir(parents=True)
        (Path(spec.cfg.out) / "provenance.json").write_text(json.dumps({"code_version": v}))
    assert suite.made_by(learning, finals) == {"old0001", "now1234"}
    assert suite.made_by(learning, finals[:1] + [finals[0]]) == {"old0001"}
    (tmp_path / bench.id).mkdir()
    (tmp_path / bench.id / "commands.txt").write_text("# made by: x\n# code version: bench12\npsgd bench\n")
    assert suite.made_by(bench, []) == {"bench12"}


# -- the forest plot and the noise floor ---------------------------------------------------------
def fake_runs(root: Path, label: str, accuracies: list[float]) -> list:
    """(spec, summary) pairs of finished runs, one seed each, ending at the given accuracy."""
    out = []
    for seed, acc in enumerate(accuracies):
        folder = root / f"{label}-{seed}"
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"mode": "sync", "config": {"seed": seed}}))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "test_accuracy": acc}) for v in range(4)))
        out.append((SimpleNamespace(label=label, cfg=SimpleNamespace(out=str(folder))), {}))
    return out


def test_the_noise_floor_is_the_far_end_of_two_identical_algorithms_paired_difference(tmp_path):
    summaries = fake_runs(tmp_path, "sync", [0.62, 0.61, 0.63]) + fake_runs(tmp_path, "allreduce", [0.63, 0.60, 0.63])
    exp = SimpleNamespace(id="E1", path="e1.toml", params={"noise_floor": ["sync", "allreduce"]})
    floor = analysis_kit.noise_floor_of(exp, summaries)
    expected = stats.diff_ci([0.62, 0.61, 0.63], [0.63, 0.60, 0.63])
    assert floor.diff == expected and floor.pair == ("sync", "allreduce")
    assert floor.value == pytest.approx(max(abs(expected.lo), abs(expected.hi)))
    assert analysis_kit.noise_floor_of(SimpleNamespace(id="E2", path="x", params={}), summaries) is None
    with pytest.raises(ValueError, match="names two labels"):
        analysis_kit.noise_floor_of(SimpleNamespace(id="E1", path="e1.toml", params={"noise_floor": ["a"]}),
                                    summaries)
    # The report states it, and summary.json keeps it.
    effects = V.sync_beats_async(stats.Interval(0.05, 0.02, 0.08, 3)).effects
    sections = [Section("E1", "t", "c", "", "confirmed", "k", "b", effects=effects), section("E5")]
    text = report.write(tmp_path, sections, command="c", wall_s=1.0, noise=floor).read_text()
    assert "## The noise floor" in text and f"**{floor.value:.3f}**" in text
    assert json.loads((tmp_path / "summary.json").read_text())["noise_floor"]["value"] == pytest.approx(floor.value)
    # The forest plot opens the report, before the verdict table, with its CSV beside it.
    assert text.index("![forest](forest.png)") < text.index("| claim | verdict |")
    assert (tmp_path / "forest.png").exists() and "E1,confirmed,sync - async" in (tmp_path / "forest.csv").read_text()


def test_a_claim_its_configuration_decides_is_labelled_by_construction_everywhere():
    s = section("E2", "q", "", "000")
    s.by_construction = "the barrier makes sync wait for the sleep"
    assert "**confirmed** (by construction)" in report.verdict_table([s])
    record = report.claim_record(s)
    assert record["by_construction"] == s.by_construction
    summary = {"command": "c", "code_version": "v", "machine": "m", "wall_s": 60.0, "claims": [
        {"id": "E2", "title": "t", "verdict": "confirmed", "headline": "h", **record}]}
    assert "**confirmed** (by construction)" in readme.readme_block(json.loads(json.dumps(summary)))
    # The suite's claims that say so: E2, E6, E10, E11, and E7 for its every-step part (issue 57).
    marked = {e.id for e in suite.load_suite(SUITE, "default") if e.by_construction}
    assert marked == {"E2", "E6", "E7", "E10", "E11"}


def test_the_default_report_says_whether_the_reference_profile_agrees():
    s = section("E2", "q", "", "000")
    ref = {"claims": [{"id": "E2", "verdict": "refuted", "power": {"seeds_run": 11}}]}
    assert seeds_table.reference_cell(s, ref) == "refuted (11 seeds): **differs**"
    assert seeds_table.reference_cell(s, {"claims": [{"id": "E2", "verdict": "confirmed"}]}) == "confirmed: agrees"
    bench = {"claims": [{"id": "E2", "verdict": "confirmed",
                         "power": {"seeds_run": 3, "replicates": "benchmark rounds"}}]}
    assert seeds_table.reference_cell(s, bench) == "confirmed (3 rounds): agrees"   # a benchmark's replicates
    one = {"claims": [{"id": "E2", "verdict": "confirmed", "power": {"seeds_run": 1, "replicates": "seeds"}}]}
    assert seeds_table.reference_cell(s, one) == "confirmed (1 seed): agrees"
    assert seeds_table.reference_cell(s, None) == "not run yet"
    s.power = {"seeds_run": 3, "seeds_asked": 11, "three_decide": False, "replicates": "seeds"}
    table = "\n".join(seeds_table.seeds_table([s], ref))
    assert "| reference profile |" in table and "refuted (11 seeds): **differs** |" in table
    assert "reference profile" not in "\n".join(seeds_table.seeds_table([s], ref, profile="reference"))
    # Like with like (issue 57): the table says whether one training code on one machine made both.
    ref.update(run_code_version="aaaaaaa", machine="Xeon")
    same = "\n".join(seeds_table.seeds_table([s], ref, made=("aaaaaaa", "Xeon")))
    assert "the same code on the same machine, so the column compares like with like" in same
    apart = "\n".join(seeds_table.seeds_table([s], ref, made=("bbbbbbb", "EPYC")))
    assert "by training code `aaaaaaa` on Xeon; these, by `bbbbbbb` on EPYC: another training code and another " \
           "machine, so a difference may be theirs" in apart
