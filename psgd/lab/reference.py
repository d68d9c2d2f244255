"""`python -m psgd.lab.reference plan SUITE.toml FOREST.csv [--cap-min 60]`: the reference profile's seeds.

From a report's forest.csv (the spread each claim's parts measured), the seeds the power rule asks
for per claim (psgd/lab/power.py `part_power`), capped by the suite's own ETA so that the suite
runs in at most `--cap-min` minutes on 2 cores (`power.reference_plan`), and a benchmark's rounds
(`power.reference_rounds`); prints one line per claim and where the cap binds. The claim files'
[profiles.reference] seeds (and E4's bench_args rounds) were written from its output.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterable
from pathlib import Path

from psgd.lab import stats
from psgd.lab.power import part_power, reference_plan, reference_rounds


def asked_from_forest(path: Path, bench_ids: Iterable[str] = ()) -> dict[str, int]:
    """Per claim of a report's forest.csv, the seeds the power rule asks for (its largest part's)."""
    bench_ids = set(bench_ids)
    by: dict[str, list] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("lo"):
                continue
            ci = stats.Interval(float(row["estimate"]), float(row["lo"]), float(row["hi"]), int(row["seeds"]))
            by.setdefault(row["claim"], []).append(part_power(row["effect"], ci, float(row["margin"]),
                                                              row["claim"] in bench_ids))
    return {claim: max(p["seeds_asked"] for p in parts if p["seeds_asked"] is not None)
            for claim, parts in by.items() if any(p["seeds_asked"] is not None for p in parts)}


def main(argv: list[str]) -> int:
    """The command of the module docstring."""
    if len(argv) < 3 or argv[0] != "plan":
        print("usage: python -m psgd.lab.reference plan SUITE.toml FOREST.csv [--cap-min 60]", file=sys.stderr)
        return 2
    cap_min = float(argv[argv.index("--cap-min") + 1]) if "--cap-min" in argv else 60.0
    from psgd.lab.loader import load_suite
    from psgd.lab.runner import estimate_s

    experiments = load_suite(Path(argv[1]), "default", results=Path("/nonexistent-results"))
    asked = asked_from_forest(Path(argv[2]), [e.id for e in experiments if e.bench])
    seeds, cap, eta = reference_plan(experiments, asked, cap_min * 60, lambda exps: estimate_s(exps, fresh=True))
    for e in experiments:
        if e.id in seeds:
            bound = " (capped)" if cap is not None and asked[e.id] > seeds[e.id] else ""
            print(f"{e.id}: rule asks {asked[e.id]}, reference {seeds[e.id]}{bound}  [{e.path.name}]")
        elif e.bench and e.id in asked:
            print(f"{e.id}: rule asks {asked[e.id]} rounds, reference {reference_rounds(asked[e.id])} rounds "
                  f"([profiles.reference.bench_args] rounds)  [{e.path.name}]")
    print(f"ETA {eta / 60:.1f} min on 2 cores" + (f"; cap {cap} seeds binds" if cap is not None else "; no cap binds"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
