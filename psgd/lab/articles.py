"""The seed articles: their titles and an English summary of their claims, read from a TOML file.

Contract:
- A suite file may name the file (`[suite] articles = "seed_articles.toml"`, relative to it);
  `suite_articles(suite_path, ids)` reads it, or returns () when the suite names none.
- The file is data (experiments/seed_articles.toml), never typed into Python: `[[articles]]`, each
  with an optional `id` (the article's number, "000" for shared/seeds/000_*.txt: what an
  experiment's `quote_source` names), `title` (the original), `title_en`, and `[[articles.claims]]`,
  each with `text` (one claim, in English) and either `tested_by = ["E1", ...]` (the experiment ids
  that measure it) or `not_tested = "why, in a few words"`. A bad key or value, or an id that is not
  one of the suite's experiments, is a SuiteError naming the file and the key.
- REPORT.md prints them once, as "The seed articles" (psgd/lab/report.py). Each experiment's own
  words from an article are its `quote`, their English its `quote_en`, the article's number its
  `quote_source` (psgd/lab/experiment.py).
Pure reading: no process, no plotting.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from psgd.lab.loader import read_toml
from psgd.lab.settings import SuiteError

ARTICLE_KEYS = {"id", "title", "title_en", "claims"}
CLAIM_KEYS = {"text", "tested_by", "not_tested"}


@dataclass(frozen=True)
class Claim:
    """One claim of an article, in English, and which experiments test it (or why none does)."""
    text: str
    tested_by: tuple[str, ...] = ()
    not_tested: str = ""


@dataclass(frozen=True)
class Article:
    """One seed article: its title as published, in English, and its claims; `id` its number ("000")."""
    title: str
    title_en: str
    claims: tuple[Claim, ...]
    id: str = ""


def _text(table: dict, key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value.strip():
        raise SuiteError(f"{where}: key {key!r} is required (a non-empty string)")
    return " ".join(value.split())


def _claim(table: object, ids: Collection[str] | None, where: str) -> Claim:
    if not isinstance(table, dict):
        raise SuiteError(f"{where}: must be a table")
    unknown = set(table) - CLAIM_KEYS
    if unknown:
        raise SuiteError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(CLAIM_KEYS))})")
    text = _text(table, "text", where)
    if ("tested_by" in table) == ("not_tested" in table):
        raise SuiteError(f"{where}: needs exactly one of 'tested_by' (experiment ids) or 'not_tested' (why not)")
    if "not_tested" in table:
        return Claim(text, not_tested=_text(table, "not_tested", where))
    tested_by = table["tested_by"]
    if not isinstance(tested_by, list) or not tested_by or not all(isinstance(i, str) for i in tested_by):
        raise SuiteError(f"{where}: key 'tested_by' must be a non-empty list of experiment ids")
    if ids is not None:
        missing = [i for i in tested_by if i not in ids]
        if missing:
            raise SuiteError(f"{where}: key 'tested_by' names {missing[0]!r}, which is not an experiment of the "
                             f"suite ({', '.join(ids)})")
    return Claim(text, tested_by=tuple(tested_by))


def load_articles(path: Path, ids: Collection[str] | None = None) -> tuple[Article, ...]:
    """The articles of `path`, validated; `ids` (when given) are the experiment ids a claim may name."""
    doc = read_toml(path)
    if set(doc) - {"articles"}:
        raise SuiteError(f"{path}: unknown key {sorted(set(doc) - {'articles'})[0]!r} (known: articles)")
    tables = doc.get("articles")
    if not isinstance(tables, list) or not tables:
        raise SuiteError(f"{path}: needs at least one [[articles]] table")
    articles = []
    for i, table in enumerate(tables, 1):
        where = f"{path} [[articles]] #{i}"
        if not isinstance(table, dict):
            raise SuiteError(f"{where}: must be a table")
        unknown = set(table) - ARTICLE_KEYS
        if unknown:
            raise SuiteError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(ARTICLE_KEYS))})")
        claims = table.get("claims")
        if not isinstance(claims, list) or not claims:
            raise SuiteError(f"{where}: needs at least one [[articles.claims]] table")
        article_id = table.get("id", "")
        if "id" in table and (not isinstance(article_id, str) or not article_id.strip()):
            raise SuiteError(f"{where}: key 'id' must be a non-empty string (the article's number)")
        articles.append(Article(_text(table, "title", where), _text(table, "title_en", where),
                                tuple(_claim(c, ids, f"{where} claim #{j}") for j, c in enumerate(claims, 1)),
                                article_id.strip()))
    return tuple(articles)


def suite_articles(suite_path: Path, ids: Collection[str] | None = None) -> tuple[Article, ...]:
    """The articles the suite file names (`[suite] articles = "FILE"`, relative to it), or ()."""
    name = read_toml(suite_path).get("suite", {}).get("articles")
    if name is None:
        return ()
    if not isinstance(name, str) or not name:
        raise SuiteError(f"{suite_path}: key 'suite.articles' must be a file name")
    return load_articles(suite_path.parent / name, ids)
