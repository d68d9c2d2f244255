"""The report's "Seeds: run and asked" table (psgd/lab/report.py writes it): per claim the seeds it ran,
what the power rule asks for, whether 3 seeds decide it, its split halves, where its runs are scored
and, in a default profile's report, what the reference profile read and whether it agrees.

Contract:
- `seeds_table(sections, reference, profile, made)`: the table's lines ([] where no section has
  power or halves); `reference`: the reference profile's summary.json (None: not run); `made`:
  these runs' training code and machine.
- `reference_cell(section, reference)`: the last column: the reference's verdict (its seeds or
  rounds) and "agrees" or "**differs**".
- `like_with_like(reference, run_version, ran_on)`: the sentence saying whether the reference and
  these seeds were made by one training code on one machine (issue 57), and if not, that a
  difference may be the code's or the machine's.
"""

from __future__ import annotations

from collections.abc import Mapping

from psgd.lab import stats


def like_with_like(reference: Mapping, run_version: str, ran_on: str) -> str:
    """The sentence on what made the reference profile and these seeds (issue 57: an "agrees" column
    compares like with like only where one training code on one machine made both)."""
    theirs = (reference.get("run_code_version", "?"), reference.get("machine", "?"))
    text = (f"The reference profile's runs are by training code `{theirs[0]}` on {theirs[1]}; these, by "
            f"`{run_version or '?'}` on {ran_on or '?'}: ")
    apart = [what for what, a, b in (("training code", theirs[0], run_version), ("machine", theirs[1], ran_on))
             if a != b]
    return text + ("the same code on the same machine, so the column compares like with like." if not apart else
                   f"another {' and another '.join(apart)}, so a difference may be theirs, not the seeds'.")


def reference_cell(s, reference: Mapping | None) -> str:
    """What the reference profile (the power rule's seeds) read for this claim, and whether it agrees."""
    if reference is None:
        return "not run yet"
    theirs = {c["id"]: c for c in reference.get("claims", [])}.get(s.id)
    if theirs is None:
        return "not in it"
    power = theirs.get("power") or {}
    seeds = power.get("seeds_run")
    unit = "round" if "rounds" in (power.get("replicates") or "") else "seed"   # a benchmark's replicates
    said = f"{theirs['verdict']}" + (f" ({seeds} {unit}{'s' * (seeds != 1)})" if seeds else "")
    return f"{said}: {'agrees' if theirs['verdict'] == s.verdict else '**differs**'}"


def seeds_table(sections: list, reference: Mapping | None = None, profile: str = "default",
                made: tuple[str, str] = ("", "")) -> list[str]:
    """"Seeds: run and asked": per claim, the seeds it ran, what the power rule asks for, whether 3
    seeds can decide it, whether its split halves agree, where its runs are scored, and (in the
    default profile) what the reference profile read and whether it agrees (`reference`: its
    summary.json; None: not run; `made`: these runs' training code and machine, which the table's
    intro holds against the reference's: `like_with_like`)."""
    with_reference = profile == "default"
    rows = []
    for s in sections:
        pw, halves = getattr(s, "power", None), getattr(s, "halves", None)
        if not pw and not halves:
            continue
        asked = "" if not pw or pw["seeds_asked"] is None else str(pw["seeds_asked"])
        three = "" if not pw or pw["three_decide"] is None else ("yes" if pw["three_decide"] else "no")
        split = ""
        if halves:
            read = all(halves[h]["verdict"] for h in ("first", "second"))
            split = ("**unstable**" if halves["unstable"] else "agree" if halves["first"]["verdict"] ==
                     halves["second"]["verdict"] else "differ, no contradiction") if read else "not read"
        unit = "" if not pw or pw["replicates"] == "seeds" else " (rounds)"
        scored = {"end": "end of budget", "best_val": "best validation"}.get(getattr(s, "scoring", ""), "")
        rows.append(f"| [{s.id}](#{s.id.lower()}) | {pw['seeds_run'] if pw else ''}{unit} | {asked} | {three} | "
                    f"{split} | {scored} |" + (f" {reference_cell(s, reference)} |" if with_reference else ""))
    if not rows:
        return []
    return ["", "## Seeds: run and asked", "",
            "Per claim: the seeds it ran; the seeds the power rule asks for (the smallest n whose 95% t interval "
            "has a half-width at most half the claim's margin, at the paired seed-to-seed spread measured here, "
            f"and at least {stats.POWER_FLOOR} where seeds are the replicates: psgd/lab/power.py); whether 3 seeds "
            "can decide it by that rule; whether the verdicts on the two halves of the seeds agree (unstable: one "
            "half confirmed, the other refuted); and where each run is scored. Each claim's section gives its "
            "margins and why each is the smallest effect of interest. `make experiments-reference` runs the seeds "
            "asked for (capped by each suite's time on 2 cores: the experiment files say where the cap binds)"
            + ("; the last column is what that reference profile read, and whether it agrees with these seeds."
               + (f" {like_with_like(reference, *made)}" if reference else "") if with_reference else "."), "",
            "| claim | seeds run | power rule asks | 3 seeds decide | split halves | scored |"
            + (" reference profile |" if with_reference else ""),
            "|---|---|---|---|---|---|" + ("---|" if with_reference else ""), *rows]
