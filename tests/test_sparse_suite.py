"""experiments/sparse.toml (`make experiments-sparse`, psgd/lab/analyses_sparse.py): its quick profile
runs end to end, each claim gets a verdict from its rule, and the numbers behind them come out of
the runs (per-row below global staleness; range's busiest shard above hash's; the crossover not
testable on one host, with the bytes per step beside it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from psgd.lab import suite
from psgd.lab import verdicts as V
from tests.helpers import psgd_main

SUITE = Path(__file__).resolve().parents[1] / "experiments" / "sparse.toml"


def test_the_sparse_suite_holds_e24_to_e26_and_the_default_suite_none_of_them():
    assert [e.id for e in suite.load_suite(SUITE, "default")] == ["E24", "E25", "E26"]
    default = suite.load_suite(SUITE.parent / "default.toml", "default")
    assert not {"E24", "E25", "E26"} & {e.id for e in default}


def tiny_copy(folder: Path) -> Path:
    """The sparse suite with each experiment's quick profile shrunk to what the asserts below need:
    one seed, fixed rates (no tuning), 2 async workers, a few updates. The suite's own quick profile
    (about 30 four-worker runs) is what `make experiments-sparse --quick`-style smoke runs are for;
    here the mechanics are under test, and every run costs process start-up."""
    tiny = '[profiles.quick]\nseeds = [0]\nnum_samples = 400\nlr = 0.05\n'
    for src in sorted(SUITE.parent.glob("e2[456]_*.toml")):
        text = src.read_text()
        text = re.sub(r"^\[tune\]\n(?:\w+ = .*\n)+", "", text, flags=re.M)   # E24: fixed rates
        text = re.sub(r"^\[profiles\.quick\]\n(?:[^\[\n].*\n)*", "", text, flags=re.M)  # ours instead
        (folder / src.name).write_text(text.replace("\nworkers = 4\n", "\nworkers = 2\n") + tiny)
    (folder / "sparse.toml").write_text(SUITE.read_text().replace("\nworkers = 4\n", "\nworkers = 2\n"))
    return folder / "sparse.toml"


@pytest.mark.usefixtures("warm_suites")  # the runs fork from the tests' warm parent: the analyses are under test
def test_the_quick_profile_gives_every_claim_a_verdict_from_the_runs(tmp_path):
    suite_file = tiny_copy(tmp_path)
    out = tmp_path / "results"
    r = psgd_main("suite", str(suite_file), "--quick", "--out", str(out))
    assert r.returncode == 0, r.stderr
    claims = {c["id"]: c for c in json.loads((out / "summary.json").read_text())["claims"]}
    assert set(claims) == {"E24", "E25", "E26"}
    assert all(c["verdict"] in V.OUTCOMES for c in claims.values())
    e24 = claims["E24"]["key"]
    assert 0 <= e24["per_row_staleness"] < e24["global_staleness"]
    e25 = claims["E25"]["key"]
    assert e25["range_busiest"] > e25["hash_busiest"] >= 0.5
    e26 = claims["E26"]
    assert e26["verdict"] == V.NOT_TESTABLE  # one host: the processes share its cores and loopback
    # All-reduce moves every table whole; the PS the dense part and the touched rows.
    assert e26["key"]["dlrm_sync_bytes_per_step"] < e26["key"]["dlrm_allreduce_bytes_per_step"]
    assert "E26" in (out / "REPORT.md").read_text()
