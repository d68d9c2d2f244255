"""Figures are checked for content (series, labels, bands), not pixels."""

from pathlib import Path

import matplotlib.colors
import pytest

from psgd.lab import plots
from tests.helpers import psgd_main

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")


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
    # Staleness is discrete: bars side by side at each value (0.85 wide together), over the whole
    # range where the tail is not thin, a repeated mode hatched; seeds pooled by summing their counts.
    assert plots.pooled([{"0": 1, "2": 3}, {"2": 1, "30": 1}]) == {"0": 1, "2": 4, "30": 1}
    fig = plots.histograms({"N=2": ("async", {"0": 5, "1": 15}), "N=4": ("async", {"2": 1, "3": 2, "28": 1})},
                           tmp_path / "h.png", logy=True)
    ax = fig.axes[0]
    assert not ax.get_lines()
    assert [round(p.get_height(), 3) for p in ax.patches] == [0.25, 0.75, 0.25, 0.5, 0.25]
    assert ax.patches[0].get_hatch() in (None, "") and ax.patches[2].get_hatch() == "//"
    assert ax.get_xlim()[1] > 28 and ax.get_yscale() == "log" and ax.get_xlabel() == "staleness (updates)"
    assert [round(p.get_width(), 3) for p in ax.patches] == [0.425] * 5 and not ax.texts


def test_a_thin_staleness_tail_does_not_shrink_the_bars(tmp_path):
    """One gradient at 109 among 400 at 0-3: the axis ends at the 99.5th percentile (3), the note
    states the maximum and the gradients beyond it, and the bars are solid and 0.85 wide."""
    hist = {"0": 100, "1": 150, "2": 100, "3": 49, "109": 1}
    assert plots.clip_at(hist) == 3 and plots.clip_at({"0": 5, "1": 15}) == 1
    fig = plots.histograms({"async": ("async", hist)}, tmp_path / "h.png", title="staleness")
    ax = fig.axes[0]
    assert ax.get_xlim() == (-0.6, 3.6)
    assert [t.get_text() for t in ax.texts] == ["axis ends at the 99.5th percentile, 3; 1 gradient(s) beyond it, "
                                                "up to 109"]
    assert {round(p.get_width(), 3) for p in ax.patches} == {0.85}
    assert all(p.get_facecolor() == p.get_edgecolor() and p.get_facecolor()[3] == 1.0 for p in ax.patches)
    assert (tmp_path / "h.csv").read_text().count("\n") == 6  # the CSV keeps the tail


def test_a_curves_figure_has_a_title_by_default(tmp_path, monkeypatch):
    """README's first figure (psgd plot RUN RUN --x samples) is titled by what it plots."""
    seen = {}
    monkeypatch.setattr(plots, "load_run", lambda run: type("Run", (), {"mode": Path(run).name, "summary": {},
                                                                         "evals": [{"test_accuracy": 0.5}]})())
    monkeypatch.setattr(plots, "curves", lambda series, x, y, path, title: seen.update(title=title))
    argv = ["results/runs/sync", "results/runs/async", "--x", "samples", "--out", str(tmp_path / "f.png")]
    assert plots.main(argv) == 0
    assert seen["title"] == "test accuracy against training samples processed: sync, async"


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


def test_the_forest_draws_ratios_and_differences_of_ratios_on_axes_of_their_own(tmp_path):
    """Issue 57: E20's time ratios (null 1) sat on an axis labelled "difference of ratios" beside E2's."""
    from psgd.lab import verdicts as V
    from psgd.lab.forest import UNIT_AXES
    from psgd.lab.stats import Interval

    claims = [("E2", V.CONFIRMED, list(V.straggler_hurts_sync_more(Interval(3.0, 2.0, 4.0, 3)).effects)),
              ("E20", V.CONFIRMED, [V.part("sync / async time", Interval(1.5, 1.3, 1.7, 3), 0.1, "effect", V.RATIO,
                                           null=1.0)])]
    fig = plots.forest(claims, tmp_path / "forest.png", "t")
    assert [ax.get_xlabel() for ax in fig.axes] == ["difference of two ratios (x)", "ratio (x)"]
    assert "scoring" in UNIT_AXES["accuracy"]


def test_dot_plots_span_the_data_and_leave_out_what_was_not_measured(tmp_path):
    fig = plots.dots(["batch 128", "batch 1024, batch-128 rate", "c"],
                     {"acc": ("variant:0", [0.61, 0.62, float("nan")], [(0.60, 0.62), (0.615, 0.625), (0, 0)]),
                      "paper": ("variant:3", [0.68, 0.68, 0.68], None)}, "accuracy", tmp_path / "d.png")
    ax = fig.axes[0]
    assert ax.get_ylim()[0] > 0.5          # not from zero: a one-point difference stays visible
    assert "\n" in ax.get_xticklabels()[1].get_text()     # long names wrap instead of overlapping
    rows = (tmp_path / "d.csv").read_text().splitlines()
    assert rows[0] == "series,mode,group,value,lo,hi" and len(rows) == 1 + 2 + 3
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["acc", "paper"]


def test_a_bar_never_made_is_left_out_not_drawn_at_zero(tmp_path):
    nan = float("nan")
    fig = plots.bars(["a", "b"], {"sync": ("sync", [1.0, nan], [(0.9, 1.1), (nan, nan)]),
                                  "async": ("async", [2.0, 3.0], [(1.9, 2.1), (2.9, 3.1)])}, "samples/s",
                     tmp_path / "b.png")
    assert [round(p.get_height(), 3) for p in fig.axes[0].patches] == [1.0, 2.0, 3.0]
    assert [r.split(",")[2] for r in (tmp_path / "b.csv").read_text().splitlines()[1:]] == ["a", "a", "b"]


def test_categories_are_points_with_error_bars_and_throughput_starts_at_zero(tmp_path):
    ys = {"every step": ("sync", [0.62, 0.60], [(0.61, 0.63), (0.59, 0.61)]),
          "local": ("local", [0.63, 0.58], [(0.60, 0.66), (0.55, 0.61)])}
    fig = plots.lines([0, 1], ys, "skew", "accuracy", tmp_path / "l.png", xticklabels=["IID", "Dir(0.1)"])
    ax = fig.axes[0]
    assert not ax.collections or all(type(c).__name__ == "LineCollection" for c in ax.collections)  # no band
    data = [c.lines[0] for c in ax.containers]       # each series' markers (an ErrorbarContainer each)
    assert len(data) == 2 and all(line.get_linestyle() == "None" for line in data)   # no line between categories
    assert list(data[0].get_xdata()) != list(data[1].get_xdata())   # nudged apart: the error bars do not overlap
    fig = plots.lines([1, 2, 4], {"ps": ("sync", [900.0, 1500.0, 1900.0])}, "N", "samples/s", tmp_path / "t.png",
                      logx=True, ymin0=True)
    assert fig.axes[0].get_ylim()[0] == 0


def test_the_grid_map_can_shade_accuracy_and_hatch_the_diverged_cells(tmp_path):
    fig = plots.grid_map(["N=1", "N=4"], ["0.1", "0.3"], [[0.6, 0.1], [0.2, 0.1]], [["0.60", "0.10"], ["0.20", "0.10"]],
                         tmp_path / "m.png", cmap="cividis", vmax=0.6, hatched=[[False, True], [False, True]])
    ax = fig.axes[0]
    assert [p.get_hatch() for p in ax.patches] == ["///", "///"]
    assert ax.images[0].get_cmap().name == "cividis"


def test_sync_with_backup_workers_is_not_drawn_in_sync_s_colour():
    from psgd.lab.analysis_kit import series_of
    from psgd.lab.results import Group

    def group(label, backup):
        return Group(label, [plots.RunData({"mode": "sync", "config": {"seed": 0, "backup_workers": backup}}, [])])

    plain, backup = series_of([group("sync", 0), group("sync b=1", 1)])
    assert plots.color(plain.mode, plain.variant) == plots.MODE_COLORS["sync"]
    assert plots.color(backup.mode, backup.variant) not in plots.MODE_COLORS.values()


def test_regression_runs_are_plotted_by_their_loss(tmp_path):
    """Issue 54, item 3: `psgd plot` on two --loss mse runs drew an empty figure (test accuracy, all
    nan) with exit 0, and its loss axis said "cross-entropy"."""
    import json

    folders = []
    for mode in ("sync", "async"):
        folder = tmp_path / f"mse-{mode}"
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps({"mode": mode, "config": {"model": {"loss": "mse"}}}))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "elapsed_s": 0.1 * v, "samples": 32 * v, "test_loss": 4.0 / (1 + v),
             "test_accuracy": None}) for v in range(4)))
        folders.append(str(folder))
    r = psgd_main("plot", *folders, "--out", str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    rows = (tmp_path / "p.csv").read_text().splitlines()
    assert rows[0] == "series,mode,elapsed_s,test_loss_mean,test_loss_min,test_loss_max" and "nan" not in "".join(rows)
    r = psgd_main("plot", *folders, "--y", "test_accuracy", "--out", str(tmp_path / "a.png"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "use --y test_loss" in r.stderr
    assert not (tmp_path / "a.png").exists()
    fig = plots.curves([plots.Series(Path(f).name, Path(f).name[4:], [plots.load_run(f)]) for f in folders],
                       "samples", "test_loss", tmp_path / "l.png")
    assert fig.axes[0].get_ylabel() == "test loss (mse)"
    fig = plots.curves([plots.Series("sync", "sync", [fake_run("sync", 0.8, 0)])], "samples", "test_loss",
                       tmp_path / "c.png")
    assert fig.axes[0].get_ylabel() == "test loss (cross-entropy)"   # a run that does not say: the default


def test_a_sentence_long_effect_label_does_not_squeeze_the_forest(tmp_path):
    """Issue 54, item 6: E12's label, a sentence, squeezed the forest's panels into a third of the
    canvas ("Tight layout not applied"); the row's name is cut, the CSV keeps it whole."""
    import warnings

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from psgd.lab import verdicts as V
    from psgd.lab.forest import LABEL_CHARS
    from psgd.lab.stats import Interval

    long = ("one worker (control) - plain async (the gap), at N=4, lr 0.03 (plain async's best rate of {0.03, 0.1, "
            "0.3}: the lowest of the grid, a smaller rate may do better), the one-worker control minus plain async "
            "is +0.042 [+0.004, +0.080]")
    claims = [("E12", V.INCONCLUSIVE, [V.part(long, Interval(0.04, 0.004, 0.08, 3), 0.05, "effect")]),
              ("E1", V.INCONCLUSIVE, list(V.sync_beats_async(Interval(0.01, -0.02, 0.04, 3)).effects))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # "Tight layout not applied" is a UserWarning
        fig = plots.forest(claims, tmp_path / "forest.png", "t")
    ax = fig.axes[0]
    assert all(len(t.get_text()) <= len("E12: ") + LABEL_CHARS for t in ax.get_yticklabels())
    FigureCanvasAgg(fig).draw()
    assert ax.get_position().width * fig.get_figwidth() > 4.0   # inches: the panel keeps its width
    assert long in (tmp_path / "forest.csv").read_text()


def test_staleness_is_counted_once_per_gradient_on_whole_number_ticks(tmp_path):
    """Issue 54, item 6: staleness histograms had fractional ticks (0.25, 0.5 ... between whole
    updates) and summary.json counted a gradient once per shard (400 for 200 pushed)."""
    from psgd.core.config import RunConfig
    from psgd.train.metrics import Metrics, summarize

    fig = plots.histograms({"async": ("async", {"0": 120, "1": 80})}, tmp_path / "h.png")
    ticks = [t for t in fig.axes[0].get_xticks() if -0.6 < t < 1.6]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    m = Metrics(tmp_path / "metrics.jsonl")
    for rank in range(2):
        m.write(event="worker_end", rank=rank, steps=100, train_start=0.0, train_end=1.0, process_start=0.0,
                bytes_pushed=0, bytes_pulled=0, compute_s=0.0, push_s=0.0, pull_s=0.0, wait_s=0.0)
    m.close()
    shards = [{"version": 200, "staleness_hist": {"0": 120, "1": 80}, "max_clock_gap": 1},
              {"version": 200, "staleness_hist": {"0": 118, "1": 82}, "max_clock_gap": 1}]
    s = summarize(tmp_path, RunConfig(mode="async", workers=2, servers=2), [], 10, "", shards)
    assert sum(s["staleness"]["hist"].values()) == 200 == s["worker_steps"]


def test_a_run_read_back_skips_a_blank_metrics_line(tmp_path):
    """Sixteen processes appending to one metrics.jsonl: one that opened it while another appended may
    end a line it took for torn, leaving a blank line (seen in the papers suite's E21); the lab's
    reader skips it instead of failing the analysis."""
    from psgd.lab.results import load_run

    (tmp_path / "summary.json").write_text('{"mode": "async"}')
    (tmp_path / "metrics.jsonl").write_text('{"event": "eval", "version": 2, "test_accuracy": 0.5}\n\n'
                                            '{"event": "eval", "version": 1, "test_accuracy": 0.4}\n')
    assert [e["version"] for e in load_run(tmp_path).evals] == [1, 2]


def test_numbers_only_writes_the_csv_and_renders_no_figure(tmp_path):
    # A claim's reading at its other scoring runs its analysis again for the verdict alone
    # (psgd/lab/readings.py): its figures would go into a folder thrown away.
    from psgd.lab import figure_kit

    fig, ax = figure_kit.plt.subplots()
    ax.plot([0, 1], [1, 0])
    with figure_kit.numbers_only():
        figure_kit.save(fig, tmp_path / "a.png", ["x", "y"], [[0, 1], [1, 0]])
    figure_kit.save(fig, tmp_path / "b.png", ["x", "y"], [[0, 1]])
    figure_kit.plt.close(fig)
    assert not (tmp_path / "a.png").exists() and (tmp_path / "a.csv").read_text().splitlines() == ["x,y", "0,1", "1,0"]
    assert (tmp_path / "b.png").stat().st_size > 0 and (tmp_path / "b.csv").exists()
