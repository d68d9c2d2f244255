"""The suite runner, its TOML schema, and report generation on a tiny --quick suite."""

from pathlib import Path

import pytest

from psgd import suite
from tests.helpers import processes_mentioning, psgd

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
def test_default_suite_files_are_valid(profile, tmp_path):
    experiments = suite.load_suite(ROOT / "experiments" / "default.toml", profile, results=tmp_path)
    assert len(experiments) >= 7
    assert all(e.runs or e.bench for e in experiments)


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


def test_bad_suite_is_a_one_line_usage_error(tmp_path):
    write(tmp_path, "exp.toml", 'id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[[runs]]\nlabel = "a"\n'
          'lr = -1.0\n')
    suite_file = write(tmp_path, "suite.toml", '[suite]\nexperiments = ["exp.toml"]\n')
    r = psgd("suite", str(suite_file), timeout=60)
    assert r.returncode == 2 and "--lr must be > 0" in r.stderr and "exp.toml" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    write(tmp_path, "exp.toml", 'id = "X"\ntitle = "t"\nclaim = "c"\nanalysis = "modes"\n[[runs]]\nlabel = "a"\n')
    r = psgd("suite", str(suite_file), "--only", "E9", timeout=60)
    assert r.returncode == 2 and "unknown experiments" in r.stderr


def test_tiny_quick_suite_writes_figures_csvs_and_report(tmp_path):
    write(tmp_path, "modes.toml", 'id = "M"\ntitle = "modes"\nclaim = "sync is stable"\nquote = "同步"\n'
          'analysis = "modes"\n' + TINY_BASE + '[[runs]]\nlabel = "sync"\nmode = "sync"\n'
          '[[runs]]\nlabel = "async"\nmode = "async"\n[profiles.quick]\nsteps = 3\n')
    write(tmp_path, "wire.toml", 'id = "W"\ntitle = "wire"\nclaim = "half the bytes"\nanalysis = "wire"\n'
          + TINY_BASE + '[[runs]]\nlabel = "fp32"\nmode = "sync"\n[[runs]]\nlabel = "fp16"\nmode = "sync"\n'
          'wire_dtype = "fp16"\n')
    suite_file = write(tmp_path, "suite.toml", '[suite]\nexperiments = ["modes.toml", "wire.toml"]\n')
    results = tmp_path / "results"
    r = psgd("suite", str(suite_file), "--quick", "--results", str(results))
    assert r.returncode == 0, r.stderr
    report = (results / "REPORT.md").read_text()
    assert "## M" in report and "## W" in report and "> 同步" in report
    assert report.count("**Verdict: ") == 2
    for fig in ("M/accuracy_vs_elapsed_s", "M/accuracy_vs_version", "M/accuracy_vs_samples", "M/loss_vs_samples",
                "W/bytes_per_step", "W/accuracy"):
        assert (results / f"{fig}.png").stat().st_size > 0
        assert (results / f"{fig}.csv").read_text().count("\n") >= 2
        assert f"]({fig}.png)" in report
    commands = (results / "M" / "commands.txt").read_text()
    assert "psgd run --mode sync" in commands and "--steps 3" in commands   # the quick profile won
    # fp16 moved half the bytes of fp32: the CSV behind the figure says so.
    rows = (results / "W" / "bytes_per_step.csv").read_text().splitlines()[1:]
    fp32, fp16 = (float(row.split(",")[3]) for row in rows)
    assert fp16 == pytest.approx(fp32 / 2)
    # A second call reuses the finished runs.
    stamp = (results / "runs" / "M" / "sync-s0" / "summary.json").stat().st_mtime_ns
    r = psgd("suite", str(suite_file), "--quick", "--results", str(results), "--only", "M")
    assert r.returncode == 0 and "cached" in r.stderr
    report = (results / "REPORT.md").read_text()
    assert "## M" in report and "## W" in report   # --only reruns M; the report still covers W
    assert "2 of 2 runs reused" in report
    assert (results / "runs" / "M" / "sync-s0" / "summary.json").stat().st_mtime_ns == stamp
    assert processes_mentioning(str(results)) == []
