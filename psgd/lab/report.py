"""REPORT.md: one section per claim, generated from the results (never edited by hand).

Contract: `write(results, sections, command, wall_s, version=..., articles=...)` writes
`results/REPORT.md`: the machine it ran on, the command, the code version, a verdict table, "The
seed articles" (each article's title, original and English, and an English summary of its claims,
each naming the experiments that test it: psgd/lab/articles.py reads them from the suite's data
file), then for each claim: the seed's words with their English translation under them, the
claim, why this setup, the verdict with its key number (marked "unstable" where the verdicts on the
two halves of its seeds contradict each other), how its runs are scored, the seeds it ran against
those the power rule asks for (psgd/lab/power.py) and its split halves, the figures with a one-line
caption each,

the setup sentence (from the run configs), the tuning, the table of measured numbers, the rule
behind the verdict, and where the exact run commands are. It also writes `results/summary.json`
(verdicts, key numbers, code version, wall time), from which `make readme` regenerates the
verdict tables of docs/results.md (psgd/lab/readme.py; a test fails when they are stale).

Provenance: the training-code version the report states is read from what its sections cite
(each run's provenance.json, each benchmark's commands.txt: `made_by`), not from the code at hand;
summary.json lists them (`run_code_versions`), and tests/test_report.py fails when the committed
report cites runs of more than one version or names another than theirs.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import grpc
import torch

from psgd.lab import plots, power
from psgd.lab.articles import Article
from psgd.lab.seeds_table import seeds_table


def machine(kernels: str | None = None) -> str:
    """This machine, with the CPU kernels its runs used (`kernels`, as their provenance.json records
    them), else those this process would pin or use."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    # The kernels the runs used: the suite pins them (psgd/lab/runner.py pin_cpu_kernels).
    kernels = kernels or os.environ.get("ATEN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability().lower()
    return (f"{cpu}, {os.cpu_count()} cores, CPU kernels {kernels}, {gpu}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"grpcio {grpc.__version__}, {platform.system()} {platform.release()}")


def stability_note(halves: Mapping | None) -> str:
    """", unstable (seeds 0: confirmed; seeds 2: refuted)" for a claim whose split halves contradict
    each other (analyses.split_half), else ""."""
    if not halves or not halves.get("unstable"):
        return ""

    def seeds(h: Mapping) -> str:
        return f"seed{'s' * (len(h['seeds']) > 1)} {', '.join(map(str, h['seeds']))}"
    return (f", unstable ({seeds(halves['first'])}: {halves['first']['verdict']}; "
            f"{seeds(halves['second'])}: {halves['second']['verdict']})")


BY_CONSTRUCTION = " (by construction)"


def construction_note(reason: str) -> str:
    """" (by construction)" for a claim whose outcome its configuration fixes: a check that psgd
    computes what it says, not a finding (the claim's section says why)."""
    return BY_CONSTRUCTION if reason else ""


def verdict_table(sections: list, link_prefix: str = "") -> str:
    rows = ["| claim | verdict | key number |", "|---|---|---|"]
    for s in sections:
        rows.append(f"| [{s.id}]({link_prefix}#{s.id.lower()}) {s.title} | **{s.verdict}**"
                    f"{construction_note(getattr(s, 'by_construction', ''))}"
                    f"{stability_note(getattr(s, 'halves', None))} | {s.headline} |")
    return "\n".join(rows)


def halves_sentence(halves: Mapping | None) -> str:
    """The report's line on a claim's split halves: both readings, and whether they agree."""
    if not halves:
        return ""

    def reading(h: Mapping) -> str:
        said = h["verdict"] or f"not read ({h.get('error', 'no verdict')})"
        return f"seed{'s' * (len(h['seeds']) > 1)} {', '.join(map(str, h['seeds']))}: {said}"
    left = (f"; seed {', '.join(map(str, halves['left_out']))} left out of both, so the halves are the same size"
            if halves.get("left_out") else "")
    verdict = ("**unstable**: one half confirms what the other refutes" if halves["unstable"] else
               "no contradiction (a half confirmed and the other refuted would be)")
    return (f"**Split halves** (the same rule on each half of the seeds, in seed order{left}): "
            f"{reading(halves['first'])}; {reading(halves['second'])}; {verdict}.")


SCORING_WORDS = {"end": "at the end of each run's budget (the mean of its last evaluations)",
                 "best_val": "at each run's best validation point (the test figure at the evaluation of best "
                             "validation metric, as early stopping reads it)"}


def anchor(exp_id: str, ids: Collection[str]) -> str:
    """A link to an experiment's section of the report, or its bare id when the report has none."""
    return f"[{exp_id}](#{exp_id.lower()})" if exp_id in ids else exp_id


def articles_section(articles: Sequence[Article], ids: Collection[str]) -> list[str]:
    """"The seed articles": each title (original, then English) and its claims in English, each with
    the experiments that test it (linked when `ids`, the report's sections, has them) or why none does."""
    if not articles:
        return []
    lines = ["", "## The seed articles", "",
             "The articles whose claims are measured here. For each: its title as published and in English, and a "
             "summary in English of what it claims, with the experiments that test each claim. Each claim's section "
             "below opens with its quote (an article's own words, and the article's number), and an English "
             "translation under it where the quote is not in English.",
             ""]
    for a in articles:
        lines += [f"### {f'Seed article {a.id}: ' if a.id else ''}{a.title}", "", f"*{a.title_en}*", ""]
        for c in a.claims:
            where = (f"Tested by {', '.join(anchor(i, ids) for i in c.tested_by)}." if c.tested_by
                     else f"Not tested here: {c.not_tested}.")
            lines.append(f"- {c.text} {where}")
        lines.append("")
    return lines[:-1]


def quote_lines(quote: str, quote_en: str, source: str = "") -> list[str]:
    """The seed's words as a blockquote, followed by where they are from (a seed article's number
    reads "seed article 000", another source as given), with their English translation (if any)
    under them, labelled."""
    if not quote:
        return []
    if source:
        quote += f" — {'seed article ' if re.fullmatch(r'[0-9]+', source) else ''}{source}"
    return [f"> {quote}", *([">", f"> *English:* {quote_en}"] if quote_en else []), ""]


def provenance_line(version: str, run_version: str, made_by: Mapping[str, Collection[str]] | None) -> str:
    """The report's code-version line. `made_by` (experiment id -> the training-code versions
    recorded by the runs and benchmark outputs its section cites) decides what it says about the
    runs: one version is stated as such; several are listed with the experiments each made, so a
    report stitched from runs of different training code says so in its second line."""
    head = f"- Code version: `{version}` (git describe of the code that wrote this report); "
    if made_by is None:
        return head + (f"every run below was made by training code `{run_version or version}` (the last commit that "
                       "changed it; runs are cached by it)")
    by: dict[str, list[str]] = {}
    for exp_id, versions in made_by.items():
        for v in versions:
            by.setdefault(v, []).append(exp_id)
    if len(by) == 1:
        return head + (f"every run below was made by training code `{next(iter(by))}` (the last commit that changed "
                       "it, read from each run's provenance.json and each benchmark's commands.txt; runs are cached "
                       "by it)")
    return head + ("**the runs below were made by more than one version of the training code**: "
                   + "; ".join(f"`{v}` ({', '.join(ids)})" for v, ids in sorted(by.items()))
                   + " (read from each run's provenance.json and each benchmark's commands.txt)")


def cited_versions(made_by: Mapping[str, Collection[str]] | None, run_version: str) -> list[str]:
    """The distinct training-code versions behind a report (summary.json's `run_code_versions`)."""
    if made_by is None:
        return [run_version] if run_version else []
    return sorted({v for versions in made_by.values() for v in versions})


def forest_lines(results: Path, sections: list) -> list[str]:
    """The report's first figure: every claim's effects against their margins (plots.forest)."""
    if not any(s.effects for s in sections):
        return []
    path = results / "forest.png"
    plots.forest([(s.id, s.verdict, list(s.effects)) for s in sections], path,
                 "every claim: the numbers that decided its verdict")
    return [f"![forest]({path.name})", "",
            "*Every claim at a glance: each number its verdict rule weighed, with its 95% t interval over seeds "
            "(paired by seed), over a grey band of +- its margin around no effect (the vertical tick; for a share "
            "or ratio claim, the claimed threshold). A claimed effect (better by more than the margin) is confirmed "
            "when the whole interval lies right of the band's right edge, refuted when the whole interval lies left "
            "of it; a claimed \"no worse\" (marked so; a one-sided equivalence test, its bound the band's left edge) "
            "is confirmed when the whole interval lies right of the band's left edge, refuted when it lies wholly "
            "left of it; across an edge, or from one seed (no interval): inconclusive. Each margin is fixed in its "
            "experiment file; an accuracy margin below the noise floor makes its claim inconclusive (below what "
            "this setup can resolve). Marker and colour: each part's own outcome. Numbers: "
            f"[`{path.with_suffix('.csv').name}`]({path.with_suffix('.csv').name}).*", ""]


def noise_lines(noise) -> list[str]:
    """"The noise floor": what two identical algorithms measure, and what it does to the margins."""
    if noise is None:
        return []
    a, b = noise.pair
    return ["", "## The noise floor", "",
            f"{a} and {b} compute the same updates (up to the order of a floating-point sum), from the same "
            f"initialisation and data order in each seed. In [{noise.experiment}](#{noise.experiment.lower()}) their "
            f"final test accuracy differs by {noise.diff.fmt(signed=True)} ({a} minus {b}, Student t 95% over "
            f"{noise.diff.n} paired seeds): two identical algorithms can land up to **{noise.value:.3f}** apart, "
            "so a smaller accuracy difference cannot be told from run-to-run noise here. It is checked against "
            "every accuracy margin, never substituted for it (the margins are fixed in the experiment files): a "
            f"claim whose margin is below {noise.value:.3f} says it is below what this setup can resolve. "
            "It measures the noise of one setup (E1's MLP, 4 workers); the other experiments' intervals carry "
            "their own seed-to-seed spread."]


def by_part(s) -> str:
    """When a verdict combines parts that came out differently, each part's own outcome (a refuted
    part is worth saying even when the whole is inconclusive)."""
    parts = [e for e in s.effects if getattr(e, "outcome", None)]
    if len(parts) < 2 or len({e.outcome for e in parts}) < 2:
        return ""
    return " By part: " + "; ".join(f"{e.label} {e.outcome}" for e in parts) + "."


SEEDS_AT_MOST = 1000


def claim_lines(s) -> list[str]:
    """A claim's lines after its verdict: how its runs are scored, its seeds against the power
    rule's (power.sentence), and its split halves."""
    scoring = getattr(s, "scoring", "")
    said = [f"**Scored** {SCORING_WORDS[scoring]}." if scoring in SCORING_WORDS else "",
            power.sentence(getattr(s, "power", None), SEEDS_AT_MOST), halves_sentence(getattr(s, "halves", None))]
    return [x for line in said if line for x in (line, "")]


def claim_record(s) -> dict:
    """summary.json's newer fields of a claim, present where computed (an older summary lacks them
    and still renders): "scoring", "split_half" and "stability", and "power"."""
    out = {}
    if getattr(s, "scoring", ""):
        out["scoring"] = s.scoring
    if getattr(s, "halves", None):
        out["split_half"] = s.halves
        out["stability"] = "unstable" if s.halves["unstable"] else "stable"
    if getattr(s, "power", None):
        out["power"] = s.power
    if getattr(s, "by_construction", ""):
        out["by_construction"] = s.by_construction
    return out


def head_lines(results: Path, command: str, profile: str, provenance: str, ran_on: str, made: str, wall_s: float,
               note: str, reanalysed: Mapping | None) -> list[str]:
    """The report's title and its list of how it was made: command, code version, machine, date."""
    smoke = profile == "quick"
    return [
        "# psgd report: the claims of data-parallel training, measured" + (" (SMOKE RUN: --quick)" if smoke else ""),
        "",
        *(["**A smoke run: tiny budgets and one seed check that the suite runs end to end. Its numbers and "
           "verdicts are not findings.**", ""] if smoke else []),
        f"Generated by `psgd suite` from the runs under `{results}/`; do not edit by hand.",
        "",
        f"- Command: `{command}` (profile: {profile})",
        provenance,
        f"- Machine: {ran_on}",
        f"- Date: {made}; this invocation took {wall_s / 60:.1f} min" + (f" ({note})" if note else ""),
        *([f"- Re-analysed by `{reanalysed['command']}` on {reanalysed['date']}: the finished runs and benchmark "
           "outputs read again, nothing run"] if reanalysed else []),
        "- All processes ran on one machine over loopback. Intervals are Student t 95% over seeds (differences "
        "paired by seed, Welch where the seeds differ); verdicts come "
        "from the rules in psgd/lab/verdicts.py (confirmed / refuted / depends / inconclusive / not testable here).",
        "",
    ]


def section_lines(s, results: Path) -> list[str]:
    """One claim's section: quote, claim, why, verdict, scoring, seeds, figures, analysis body, commands."""
    lines = ["", f"## {s.id}", "", f"### {s.title}", ""]
    lines += quote_lines(s.quote, s.quote_en, s.quote_source)
    lines += [f"**Claim.** {s.claim}", ""]
    if s.why:
        lines += [f"**Why this setup.** {s.why}", ""]
    lines += [f"**Verdict: {s.verdict}{construction_note(getattr(s, 'by_construction', ''))}"
              f"{stability_note(getattr(s, 'halves', None))}.** {s.headline}.{by_part(s)}", ""]
    if getattr(s, "by_construction", ""):
        lines += [f"**By construction, not a finding.** {s.by_construction}", ""]
    lines += claim_lines(s)
    for fig in s.figures:
        rel = os.path.relpath(fig.path, results)
        lines += [f"![{fig.path.stem}]({rel})", "", f"*{fig.caption}*", ""]
    lines += [s.body, "", f"Exact commands: [`{s.id}/commands.txt`]({s.id}/commands.txt); "
              f"numbers behind each figure: the CSV beside it.", ""]
    return lines


def noise_record(noise) -> dict | None:
    """summary.json's "noise_floor": the experiment, the pair, their difference and the floor (None: none)."""
    if noise is None:
        return None
    return {"experiment": noise.experiment, "pair": list(noise.pair),
            "difference": [noise.diff.estimate, noise.diff.lo, noise.diff.hi], "seeds": noise.diff.n,
            "value": noise.value}


def write(results: Path, sections: list, command: str, wall_s: float, note: str = "", version: str = "",
          profile: str = "default", run_version: str = "", articles: Sequence[Article] = (),
          made_by: Mapping[str, Collection[str]] | None = None, noise=None, reference: Mapping | None = None,
          made_as: Mapping | None = None, kernels: str | None = None) -> Path:
    """Write REPORT.md and summary.json under `results`; returns the REPORT.md path. `articles`: the
    seed articles' summary, printed once after the verdict table. `made_by`: per experiment, the
    training-code versions its cited runs recorded (`provenance_line`); without it the report
    states `run_version` for every run. `noise`: the suite's noise floor (analysis_kit.NoiseFloor).
    `made_as`: for a re-analysis (`psgd suite --report`), the summary.json of the invocation that ran
    the runs: its command, date, wall time and machine stay the report's (they describe the runs), and
    this invocation is named beside them. `kernels`: the CPU kernels the runs recorded, for the
    machine line (`machine`)."""
    made = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    reanalysed = {"command": command, "date": made} if made_as else None
    if made_as:
        command, made, wall_s = made_as["command"], made_as["date"], made_as["wall_s"]
        note = made_as.get("note", "")
    ran_on = made_as["machine"] if made_as else machine(kernels)
    versions = cited_versions(made_by, run_version or version)
    if versions:
        run_version = versions[0] if len(versions) == 1 else "mixed: " + ", ".join(versions)
    lines = [
        *head_lines(results, command, profile, provenance_line(version, run_version, made_by), ran_on, made, wall_s,
                    note, reanalysed),
        *forest_lines(results, sections),
        verdict_table(sections),
        *seeds_table(sections, reference, profile, (run_version or version, ran_on)),
        *noise_lines(noise),
        *articles_section(articles, {s.id for s in sections}),
    ]
    for s in sections:
        lines += section_lines(s, results)
    path = results / "REPORT.md"
    path.write_text("\n".join(lines))
    summary = {"command": command, "profile": profile, "code_version": version,
               "run_code_version": run_version or version, "run_code_versions": versions, "machine": ran_on,
               "date": made,
               "wall_s": round(wall_s, 1), "note": note, **({"reanalysed": reanalysed} if reanalysed else {}),
               "noise_floor": noise_record(noise),
               "claims": [{"id": s.id, "title": s.title, "verdict": s.verdict, "headline": s.headline,
                           "key": s.key, **claim_record(s)} for s in sections]}
    (results / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    return path
