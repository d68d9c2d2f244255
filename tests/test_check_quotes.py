"""tools/check_quotes.py on a made-up seed folder: a quote must be one article's words, verbatim
(whitespace aside; "……" trims inside one passage). The real seed texts are not in the repository,
so this never reads them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_quotes", ROOT / "tools" / "check_quotes.py")
check_quotes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_quotes)

SEED_A = "同步更新收敛稳定。\n优点是 收敛稳定；缺点是受限于最慢节点。\n异步无需等待。\n"
SEED_B = "卡0会成为瓶颈，所有通信都压到它身上。\n"


def experiment(folder: Path, name: str, quote: str, source: str = "") -> None:
    extra = f'quote_source = "{source}"\n' if source else ""
    (folder / name).write_text(f'id = "{name.removesuffix(".toml")}"\nquote = "{quote}"\n{extra}')


def test_check_quotes_passes_verbatim_words_and_names_every_other(tmp_path, capsys):
    seeds, exps = tmp_path / "seeds", tmp_path / "experiments"
    seeds.mkdir()
    exps.mkdir()
    (seeds / "000_aaaa.txt").write_text(SEED_A)
    (seeds / "003_bbbb.txt").write_text(SEED_B)
    experiment(exps, "ok_trim.toml", "优点是收敛稳定；缺点是受限于最慢节点。……异步无需等待。", "000")  # spaces, a trim
    experiment(exps, "ok_nosource.toml", "卡0会成为瓶颈")
    experiment(exps, "paper.toml", "An English summary of a table.", "Someone 2020")
    (exps / "suite.toml").write_text('[suite]\nexperiments = []\n')          # no quote: not checked
    assert check_quotes.main([str(seeds), "--experiments", str(exps)]) == 0
    out = capsys.readouterr().out
    assert "ok   ok_trim (ok_trim.toml): verbatim in 000_aaaa.txt" in out
    assert "ok   ok_nosource (ok_nosource.toml): verbatim in 003_bbbb.txt (no quote_source)" in out
    assert "skip paper (paper.toml)" in out

    experiment(exps, "paraphrase.toml", "同步更新收敛很稳定。", "000")
    experiment(exps, "wrong_article.toml", "卡0会成为瓶颈", "000")
    experiment(exps, "two_articles.toml", "同步更新收敛稳定。……卡0会成为瓶颈")
    experiment(exps, "out_of_order.toml", "异步无需等待。……同步更新收敛稳定。", "000")
    experiment(exps, "no_file.toml", "同步更新收敛稳定。", "007")
    assert check_quotes.main([str(seeds), "--experiments", str(exps)]) == 1
    captured = capsys.readouterr()
    fails = [line for line in captured.out.splitlines() if line.startswith("FAIL")]
    assert [f.split()[1] for f in fails] == ["no_file", "out_of_order", "paraphrase", "two_articles",
                                             "wrong_article"]
    assert "'同步更新收敛很稳定。' is not there" in captured.out
    assert "names no seed file 007_*.txt" in captured.out
    assert "5 quote(s) are not the seed articles' words" in captured.err


def test_check_quotes_without_seed_texts_fails(tmp_path, capsys):
    assert check_quotes.main([str(tmp_path / "missing")]) == 1
    assert "no seed articles" in capsys.readouterr().err
