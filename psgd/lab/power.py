"""Power-sized seeds: how many seeds each claim needs, from its margin and the spread it measured.

Contract:
- Each claim's smallest effect of interest is the margin its verdict rule holds each part against
  (verdicts.Effect.margin: the margin fixed in the experiment file, `[margin]`);
  its experiment file says why that margin (`margin_why = "..."`, experiment.py), and the report
  prints it beside the numbers.
- `claim_power(effects, bench, margin_why)`: per part, the power rule of stats.seeds_for_margin (the
  smallest n with t(0.975, n-1) x sd / sqrt(n) <= margin / 2, sd the paired seed-to-seed spread read
  back from the part's interval), at least stats.POWER_FLOOR (8) where seeds are the replicates (a
  benchmark's replicates are its rounds: no floor); the claim asks for its largest part's n, and
  "3 seeds can decide it" when every sized part's half-width at 3 seeds is at most half its margin.
  A part with no readable spread (one seed, a diverged arm) or no positive margin (a share held
  against a threshold) is listed as not sized.
- `reference_plan(experiments, asked, cap_s)`: the reference profile's seeds per claim (0 .. n-1,
  so the default profile's seeds come first and are reused), all capped at the largest common
  count for which the suite's own ETA (runner.estimate_s, every run made afresh) stays within
  `cap_s`; says where the cap binds.
- `reference_rounds(asked)`: a benchmark's reference rounds, the rule's count raised to the seeds'
  floor (stats.POWER_FLOOR): a benchmark's replicates are its rounds, and a few rounds on a shared
  machine read its spread no better than a few seeds do. Not capped by the ETA (a benchmark's
  rounds are minutes, not hours).
- `python -m psgd.lab.reference plan SUITE.toml FOREST.csv [--cap-min 60]` prints that plan from a
  committed report's forest.csv (the numbers that decided each verdict), for pasting into each
  experiment file's `[profiles.reference]` (`make experiments-reference` runs that profile).
Pure arithmetic but for reading the CSV and the suite files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from psgd.lab import stats

THREE = 3   # the default profile's seeds: can they decide the claim?


def part_power(label: str, ci: stats.Interval, margin: float, bench: bool = False) -> dict:
    """One part's numbers: its margin, the spread measured, the rule's own n and what it asks for."""
    sd = stats.spread_of(ci)
    raw = stats.seeds_for_margin(ci, margin, least=2)
    asked = raw if bench or raw is None else max(raw, stats.POWER_FLOOR)
    three = None if sd is None or not margin > 0 else stats.half_width(sd, THREE) <= margin / 2
    return {"label": label, "margin": margin, "seeds_run": ci.n, "sd": sd, "rule_n": raw,
            "seeds_asked": asked, "three_decide": three}


def claim_power(effects: Iterable, bench: bool = False, margin_why: str = "") -> dict | None:
    """A claim's power summary (summary.json's "power"), or None when it weighed no interval."""
    parts = [part_power(e.label, e.ci, float(e.margin), bench) for e in effects]
    if not parts:
        return None
    sized = [p for p in parts if p["seeds_asked"] is not None]
    return {"margin_why": margin_why, "replicates": "benchmark rounds" if bench else "seeds",
            "least": 2 if bench else stats.POWER_FLOOR,
            "seeds_run": max(p["seeds_run"] for p in parts),
            "seeds_asked": max((p["seeds_asked"] for p in sized), default=None),
            "three_decide": all(p["three_decide"] for p in sized) if sized else None,
            "parts": parts, "unsized": [p["label"] for p in parts if p["seeds_asked"] is None]}


def sentence(power: dict | None, most: int = 1000) -> str:
    """The report's line on a claim's seeds: run, asked for, and whether 3 can decide it."""
    if not power:
        return ""
    unit = "rounds" if power["replicates"] == "benchmark rounds" else "seeds"
    asked = power["seeds_asked"]
    floor = f", at least {power['least']}" if power["replicates"] == "seeds" else ""
    head = (f"**Seeds.** Ran {power['seeds_run']} {unit}; the power rule (95% t half-width at most half the margin, "
            f"at the paired spread measured{floor}) asks for ")
    if asked is None:
        text = head + "a number it cannot read here (no spread or no margin to size against)"
    else:
        text = head + (f"more than {most}" if asked > most else f"{asked}")
        per = [f"{p['label']}: margin {p['margin']:.3g}, sd {p['sd']:.3g}, rule n {p['rule_n']}"
               for p in power["parts"] if p["seeds_asked"] is not None]
        text += f" ({'; '.join(per)})"
        text += f"; {THREE} seeds {'can' if power['three_decide'] else 'cannot'} decide it"
    if power["unsized"]:
        text += f"; not sized: {', '.join(power['unsized'])}"
    text += "."
    if power.get("margin_why"):
        text += f" Smallest effect of interest: {power['margin_why']}"
        text += "" if text.endswith(".") else "."
    return text


def reference_rounds(asked: int) -> int:
    """A benchmark's rounds in the reference profile (the module docstring)."""
    return max(asked, stats.POWER_FLOOR)


def reference_plan(experiments: list, asked: Mapping[str, int], cap_s: float,
                   estimate) -> tuple[dict[str, int], int | None, float]:
    """(seeds per claim id, the common cap or None where none binds, the ETA in seconds) for the
    reference profile: each learning claim in `asked` gets range(n) seeds, n its asked count,
    lowered to a common cap until the suite's ETA (`estimate(experiments)`: psgd/lab/reference.py
    passes the suite's own, every run made afresh) is within `cap_s`; never below the seeds it has now."""

    def plan(cap: int | None) -> dict[str, int]:
        out = {}
        for e in experiments:
            if e.bench or e.id not in asked:
                continue
            n = asked[e.id] if cap is None else min(asked[e.id], cap)
            out[e.id] = max(n, len(e.seeds))
        return out

    def eta(seeds: dict[str, int]) -> float:
        return estimate([dataclasses.replace(e, seeds=tuple(range(seeds[e.id]))) if e.id in seeds else e
                         for e in experiments])

    full = plan(None)
    if not full or eta(full) <= cap_s:
        return full, None, eta(full)
    lo, hi = min(len(e.seeds) for e in experiments if e.id in full), max(full.values())
    while lo < hi:   # the largest cap that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if eta(plan(mid)) <= cap_s else (lo, mid - 1)
    return plan(lo), lo, eta(plan(lo))
