"""What is checked around a claim's verdict once its rule has spoken: the margins it was fixed to, the
noise floor against them, and its other scoring.

Contract (issue 57):
- `MARGIN_UNITS`: an experiment file's `[margin]` table keys (accuracy, ratio, nats, share) and the
  verdict units (psgd/lab/verdicts.py) they fix.
- `check_margins(verdict, margins, where)`: every part the rule weighed against a positive margin
  was weighed against the margin its experiment file declares for that unit; a part in an
  undeclared unit, or at another margin, is a ValueError naming the file. Parts held against a
  threshold alone (margin 0: E5's factor, E11's share, AdamW's own cost) are not margins. So a
  claim's smallest effect of interest is the one in its TOML, the same at every profile and n.
- `resolve(verdict, floor)`: the noise floor is checked against each accuracy margin, never
  substituted for it. Where an accuracy part's margin is below the floor, that part and the claim
  are inconclusive, and the reason says the margin is below what this setup can resolve.
- `both_scorings(main, other, main_scoring, other_scoring, missing)`: a claim is read at the best
  validation point and at the end of the budget; where the two verdicts differ, the claim
  "depends on scoring" and says both; where the other could not be read, the reason says why.
- `other_scoring(scoring)`: the scoring a claim is not read at.

Pure: verdicts in, verdicts out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from psgd.lab import verdicts as V

MARGIN_UNITS = {"accuracy": V.ACCURACY, "ratio": V.RATIO, "nats": V.NATS, "share": V.SHARE}
SCORING_NAMES = {"end": "the end of the budget", "best_val": "the best validation point"}


def parse_margins(table: object, where: str) -> dict[str, float]:
    """An experiment file's `[margin]` table as {verdict unit: margin}; ValueError naming the key."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: [margin] must be a table, e.g. [margin] accuracy = 0.01")
    out = {}
    for key, value in table.items():
        if key not in MARGIN_UNITS:
            raise ValueError(f"{where}: unknown key {key!r} in [margin] (known: {', '.join(MARGIN_UNITS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{where}: [margin] {key} must be a positive number, got {value!r}")
        out[MARGIN_UNITS[key]] = float(value)
    return out


def check_margins(verdict: V.Verdict, margins: Mapping[str, float], where: str) -> None:
    """Every part weighed against a positive margin used the declared margin of its unit."""
    if not margins:
        return
    names = {unit: key for key, unit in MARGIN_UNITS.items()}
    for e in verdict.effects:
        if not e.margin > 0:
            continue
        declared = margins.get(e.unit)
        if declared is None:
            raise ValueError(f"{where}: the rule weighed {e.label!r} against a margin of {e.margin:g} "
                             f"({names.get(e.unit, e.unit)}), which [margin] does not declare")
        if abs(declared - e.margin) > 1e-12:
            raise ValueError(f"{where}: the rule weighed {e.label!r} against a margin of {e.margin:g}, but [margin] "
                             f"{names.get(e.unit, e.unit)} = {declared:g}: the margin is fixed in the file")


def _below(verdict: V.Verdict, floor: float) -> list[V.Effect]:
    return [e for e in verdict.effects if e.unit == V.ACCURACY and e.margin > 0 and e.margin < floor]


def resolve(verdict: V.Verdict, floor: float) -> V.Verdict:
    """The verdict with its accuracy margins checked against the noise floor (see the contract)."""
    below = _below(verdict, floor)
    if not below or verdict.outcome == V.NOT_TESTABLE:
        return verdict
    effects = tuple(dataclasses.replace(e, outcome=V.INCONCLUSIVE) if e in below else e for e in verdict.effects)
    margins = ", ".join(sorted({f"{e.margin:g}" for e in below}))
    note = (f"below what this setup can resolve: the accuracy margin {margins} is below the noise floor "
            f"{floor:.3f} (two identical algorithms land that far apart here), so the rule's "
            f"{verdict.outcome} is not a finding")
    return V.Verdict(V.INCONCLUSIVE, f"{verdict.reason}; {note}", effects)


def other_scoring(scoring: str) -> str:
    return "best_val" if scoring == "end" else "end"


def both_scorings(main: V.Verdict, other: V.Verdict | None, main_scoring: str, other_scoring_: str,
                  missing: str = "") -> V.Verdict:
    """The claim's verdict read at both scorings (see the contract); `missing` says why `other` is None."""
    here, there = SCORING_NAMES.get(main_scoring, main_scoring), SCORING_NAMES.get(other_scoring_, other_scoring_)
    if other is None:
        why = f": {missing}" if missing else ""
        return V.Verdict(main.outcome, f"{main.reason}; at {there}: not read{why}", main.effects)
    if other.outcome == main.outcome:
        return V.Verdict(main.outcome, f"{main.reason}; the same verdict at {there}", main.effects)
    return V.Verdict(V.DEPENDS, f"depends on scoring: {main.outcome} at {here}, {other.outcome} at {there}; "
                                f"at {here}: {main.reason}; at {there}: {other.reason}", main.effects)
