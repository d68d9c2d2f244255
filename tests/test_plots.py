"""Figures are checked for content (series, labels, bands), not pixels."""

from pathlib import Path

import matplotlib.colors

from psgd.lab import plots
from tests.helpers import psgd_main


def fake_run(mode: str, scale: float, seed: int) -> plots.RunData:
    evals = [dict(version=v, elapsed_s=v * 0.1 * (1 + seed * 0.05), samples=v * 32,
                  test_accuracy=min(1.0, scale * v / 100 + 0.01 * seed), test_loss=2.3 - scale * v / 100,
                  train_loss=2.2) for v in range(0, 101, 10)]
    return plots.RunData({"mode": mode}, evals)


def test_curves_have_one_line_per_series_a_band_for_seeds_and_labels(tmp_path):
    series = [plots.Series("sync", "sync", [fake_run("sync", 0.8, s) for s in range(3)]),
              plots.Series("async", "async", [fake_run("async", 0.6, 0)]),
              plots.Series("ssp s=1", "ssp", [fake_run("ssp", 0.7, 0)]),
              plots.Series("ssp s=3", "ssp", [fake_run("ssp", 0.65, 0)])]
    fig = plots.curves(series, "elapsed_s", "test_accuracy", tmp_path / "f.png", "title")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "wall time (s)" and ax.get_ylabel() == "test accuracy"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["sync (3 seeds)", "async", "ssp s=1", "ssp s=3"]
    lines = ax.get_lines()
    assert len(lines) == 4
    assert lines[0].get_color() == plots.MODE_COLORS["sync"] and lines[1].get_color() == plots.MODE_COLORS["async"]
    assert lines[2].get_color() == lines[3].get_color() and lines[2].get_linestyle() != lines[3].get_linestyle()
    assert len(ax.collections) == 1   # the seed band of sync only
    assert (tmp_path / "f.png").stat().st_size > 0
    csv = (tmp_path / "f.csv").read_text().splitlines()
    assert csv[0] == "series,mode,elapsed_s,test_accuracy_mean,test_accuracy_min,test_accuracy_max"
    assert {row.split(",")[0] for row in csv[1:]} == {"sync", "async", "ssp s=1", "ssp s=3"}


def test_bars_and_histograms(tmp_path):
    fig = plots.bars(["a", "b"], {"sync": ("sync", [1.0, 2.0], None), "async": ("async", [3.0, 4.0], [0.1, 0.1])},
                     "samples/s", tmp_path / "b.png")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "samples/s" and len(ax.patches) == 4
    fig = plots.histograms({"N=2": ("async", {"0": 5, "1": 15}), "N=4": ("async", {"2": 1, "3": 3})},
                           tmp_path / "h.png")
    ax = fig.axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[0.25, 0.75], [0.25, 0.75]]
    assert ax.get_xlabel() == "staleness (updates)"


def test_psgd_plot_cli(tmp_path):
    out = tmp_path / "run"
    # In this process (psgd.cli.main): the run's server and worker are real processes either way.
    r = psgd_main("run", "--mode", "sync", "--workers", "1", "--steps", "4", "--eval-every", "2", "--model", "logreg",
                  "--num-samples", "300", "--batch-size", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    r = psgd_main("plot", str(out), "--x", "version", "--y", "test_loss", "--out", str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p.png").exists() and Path(tmp_path / "p.csv").read_text().count("\n") == 4
    r = psgd_main("plot", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "no summary.json" in r.stderr
    # The other views read summary.json: the staleness histogram and where the time went.
    r = psgd_main("plot", str(out), "--view", "staleness", "--out", str(tmp_path / "s.png"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "s.csv").read_text().splitlines()[1:] == ["run,sync,0,4,1.0"]  # sync: every gradient fresh
    r = psgd_main("plot", str(out), "--view", "time", "--out", str(tmp_path / "t.png"))
    assert r.returncode == 0, r.stderr
    parts = [row.split(",")[1] for row in (tmp_path / "t.csv").read_text().splitlines()[1:]]
    assert parts == ["wait", "pull", "compute", "push", "wall time"]
    r = psgd_main("plot", str(out), "--view", "time", "--x", "version")
    assert r.returncode == 2 and "--x and --y choose the axes of --view curves" in r.stderr


def test_one_palette_modes_keep_their_colours_and_coinciding_modes_stay_visible(tmp_path):
    assert not set(plots.VARIANT_COLORS) & set(plots.MODE_COLORS.values())   # a mode's colour means that mode
    series = [plots.Series("sync", "sync", [fake_run("sync", 0.8, 0)]),
              plots.Series("allreduce", "allreduce", [fake_run("allreduce", 0.8, 0)]),   # the same curve
              plots.Series("fp16", "", [fake_run("sync", 0.7, 0)], variant=1)]
    fig = plots.curves(series, "samples", "test_loss", tmp_path / "c.png", refs=[(2.3, "chance (ln 10)")])
    ax = fig.axes[0]
    sync, allreduce, fp16, ref = ax.get_lines()
    assert sync.get_color() == plots.MODE_COLORS["sync"] and fp16.get_color() == plots.VARIANT_COLORS[1]
    # Sync and all-reduce coincide by design: told apart by marker and dash.
    assert sync.get_marker() != allreduce.get_marker() and sync.get_linestyle() != allreduce.get_linestyle()
    assert list(ref.get_ydata()) == [2.3, 2.3] and ref.get_label() == "chance (ln 10)"
    # The legend sits outside the axes (to the right), so it never covers data.
    anchor = ax.get_legend().get_bbox_to_anchor().transformed(ax.transAxes.inverted())
    assert anchor.x0 > 1.0


def test_stacked_bars_stack_in_order_with_the_segment_colours_and_a_mark(tmp_path):
    fig = plots.stacked(["sync", "async"], {"wait": [1.0, 0.0], "compute": [2.0, 3.0]}, "seconds",
                        tmp_path / "s.png", marks=("wall time", [3.5, 3.2]))
    ax = fig.axes[0]
    assert [round(p.get_height(), 3) for p in ax.patches] == [1.0, 0.0, 2.0, 3.0]
    assert [round(p.get_y(), 3) for p in ax.patches] == [0.0, 0.0, 1.0, 0.0]   # compute sits on wait
    assert ax.patches[0].get_facecolor() == matplotlib.colors.to_rgba(plots.SEGMENT_COLORS["wait"])
    # The legend reads top down, as the stack does.
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["wall time", "compute", "wait"]
    assert not set(plots.SEGMENT_COLORS.values()) & set(plots.MODE_COLORS.values())
    assert (tmp_path / "s.csv").read_text().splitlines()[-1] == "async,wall time,3.2"


def test_interval_bars_and_the_grid_map(tmp_path):
    fig = plots.bars(["a", "b"], {"acc": ("variant:0", [0.5, 0.6], [(0.4, 0.55), (0.58, 0.7)])}, "accuracy",
                     tmp_path / "b.png")
    ax = fig.axes[0]
    assert [round(p.get_height(), 3) for p in ax.patches] == [0.5, 0.6]
    fig = plots.grid_map(["N=1", "N=4"], ["0.1", "0.3"], [[0.0, 1.0], [1.0, 1.0]], [["1.2", "2.3"], ["inf", "inf"]],
                         tmp_path / "m.png")
    assert [t.get_text() for t in fig.axes[0].texts] == ["1.2", "2.3", "inf", "inf"]
    assert (tmp_path / "m.csv").read_text().splitlines()[1] == "N=1,0.1,0.0,1.2"


def test_the_forest_plot_has_a_row_per_effect_a_panel_per_unit_and_its_csv(tmp_path):
    from psgd.lab import verdicts as V
    from psgd.lab.stats import Interval

    claims = [("E1", V.INCONCLUSIVE, list(V.sync_beats_async(Interval(0.01, -0.02, 0.04, 3)).effects)),
              ("E2", V.CONFIRMED, list(V.straggler_hurts_sync_more(Interval(3.0, 2.0, 4.0, 3)).effects)),
              ("E0", V.CONFIRMED, list(V.baseline(Interval(0.3, 0.29, 0.31, 3), Interval(0.3, 0.2, 0.4, 3)).effects)),
              ("E5", V.NOT_TESTABLE, [])]
    fig = plots.forest(claims, tmp_path / "forest.png", "t")
    assert len(fig.axes) == 2      # accuracy, ratios
    acc = fig.axes[0]
    assert [t.get_text() for t in acc.get_yticklabels()] == ["E1: sync - async", "E0: MLP - logreg", "E0: CNN - MLP"]
    assert len(acc.patches) == 3 and acc.patches[0].get_width() == 2 * 0.01     # +- margin around 0
    assert [t.get_text() for t in acc.get_legend().get_texts()] == ["confirmed", "inconclusive"]
    assert any("E5 (not testable here)" in t.get_text() for t in fig.texts)
    rows = (tmp_path / "forest.csv").read_text().splitlines()
    assert rows[0] == "claim,verdict,effect,unit,test,estimate,lo,hi,seeds,null,margin,part_outcome"
    assert rows[1].startswith("E1,inconclusive,sync - async,accuracy,effect,0.01,-0.02,0.04,3,0.0,0.01,inconclusive")
    assert rows[2].startswith("E2,confirmed,sync's slowdown - async's,x,effect,3.0,2.0,4.0,3,0.0,0.2,confirmed")
    assert rows[-1].startswith("E5,not testable here,") and len(rows) == 1 + 4 + 1
