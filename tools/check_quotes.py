"""Check that every experiment's `quote` is the seed article's own words, copied verbatim.

    python tools/check_quotes.py [SEEDS_DIR] [--experiments DIR]

SEEDS_DIR holds the seed articles as NNN_<hash>.txt (default: ../shared/seeds beside this checkout;
the repository does not vendor them). Every experiments/*.toml with a `quote` is checked: the quote,
split at "……" (a trim inside one passage), must occur part by part, in order, in one seed file,
ignoring whitespace. `quote_source = "NNN"` names that file (seed article NNN); a quote without one
may come from any seed file, one file for all its parts; a `quote_source` that is not a seed number
(E0's paper) is not a seed article's, and is listed as skipped. Prints a line per quote; exits 1
naming every quote that fails.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ROOT.parent / "shared" / "seeds"
TRIM = "……"
SEED_ID = re.compile(r"[0-9]+")   # quote_source of a seed article: its file's number


def squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def find_parts(parts: list[str], text: str) -> str | None:
    """None when every part occurs in `text`, in order; else the first part that does not."""
    at = 0
    for part in parts:
        i = text.find(part, at)
        if i < 0:
            return part
        at = i + len(part)
    return None


def check(quote: str, source: str, seeds: dict[str, str]) -> tuple[bool, str]:
    """(ok, what was found or why not) for one quote; `seeds`: file name -> whitespace-free text."""
    parts = [squeeze(p) for p in quote.split(TRIM)]
    parts = [p for p in parts if p]
    if not parts:
        return False, "the quote is empty"
    if source:
        files = [n for n in seeds if n.startswith(f"{source}_")]
        if not files:
            return False, f"quote_source {source!r} names no seed file {source}_*.txt"
    else:
        files = list(seeds)
    misses = {n: find_parts(parts, seeds[n]) for n in files}
    found = [n for n, miss in misses.items() if miss is None]
    if found:
        return True, f"verbatim in {found[0]}" + ("" if source else " (no quote_source)")
    if len(files) == 1:
        return False, f"not verbatim in {files[0]}: {misses[files[0]]!r} is not there"
    return False, "not verbatim in any one seed file (" + "; ".join(f"{n} lacks {m!r}" for n, m in misses.items()) + ")"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seeds", nargs="?", type=Path, default=SEEDS, help="folder of the seed articles (NNN_*.txt)")
    ap.add_argument("--experiments", type=Path, default=ROOT / "experiments", help="folder of experiment files")
    a = ap.parse_args(argv)
    files = sorted(a.seeds.glob("*.txt")) if a.seeds.is_dir() else []
    if not files:
        print(f"no seed articles (*.txt) in {a.seeds}", file=sys.stderr)
        return 1
    seeds = {f.name: squeeze(f.read_text(encoding="utf-8")) for f in files}
    failures = 0
    for path in sorted(a.experiments.glob("*.toml")):
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
        quote, source = doc.get("quote", ""), str(doc.get("quote_source", ""))
        if not quote:
            continue
        name = f"{doc.get('id', '?')} ({path.name})"
        if source and not SEED_ID.fullmatch(source):
            print(f"skip {name}: quote_source {source!r} is not a seed article")
            continue
        ok, why = check(quote, source, seeds)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {why}")
    if failures:
        print(f"{failures} quote(s) are not the seed articles' words", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
