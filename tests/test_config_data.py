import argparse
import dataclasses
import gzip
import json
import re
import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pytest
import torch

from psgd.cli import build_parser, config_from_args
from psgd.core import config as C
from psgd.core.config import DataConfig, RunConfig, from_dict, to_argv, to_dict, validate, with_epochs_resolved
from psgd.core.errors import UsageError
from psgd.lab import settings
from psgd.train import batches, data
from psgd.train.roles import not_read


def test_argv_round_trip_rebuilds_the_config():
    cfg = RunConfig(mode="ssp", workers=3, servers=2, staleness=4, straggler=((0, 30), (2, 5)), jitter=2.5,
                    skip_nonfinite=True, fail_at=((1, 7),), data=DataConfig(dataset="mnist1d", shard_data="noniid"))
    args = build_parser().parse_args(["run", *to_argv(cfg)])
    assert config_from_args(args) == cfg
    assert from_dict(to_dict(cfg)) == cfg


def _changed(leaf: C.Leaf):
    """A value other than the field's default, of the field's type (not necessarily a valid run)."""
    if leaf.type is bool:
        return True
    if leaf.type == C.Pairs:
        return ((1, 2), (0, 5))
    if leaf.flag.choices:
        return next(c for c in leaf.flag.choices if c != leaf.default)
    return leaf.default + {int: 3, float: 0.5, str: "x"}[leaf.type]


def _toml(value):
    return [f"{a}={b}" for a, b in value] if isinstance(value, tuple) else value


def test_every_field_round_trips_through_flags_json_and_toml(monkeypatch):
    # The one-source contract: a field declared once is a flag, a config.json key and a TOML key,
    # with no other edit. Every field at once, each away from its default.
    flat = {leaf.name: _changed(leaf) for leaf in C.leaves()}
    cfg = C.from_flat(flat)
    for leaf in C.leaves():
        section = getattr(cfg, leaf.section) if leaf.section else cfg
        assert getattr(section, leaf.name) == flat[leaf.name] != leaf.default, leaf.name
    parser = build_parser()
    assert C.from_namespace(parser.parse_args(["run", *to_argv(cfg)])) == cfg
    assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg
    monkeypatch.setattr(C, "validate", lambda c: c)  # the sample values need not make a valid run
    assert settings.config_from_settings({k: _toml(v) for k, v in flat.items()}, "test") == cfg
    # ... and the defaults are the dataclass defaults everywhere.
    assert C.from_namespace(parser.parse_args(["run"])) == RunConfig() == from_dict({})


def test_every_field_has_help_and_appears_in_psgd_run_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "-h"])
    text = capsys.readouterr().out
    for leaf in C.leaves():
        assert leaf.flag.help.strip(), leaf.name
        assert f"--{leaf.name.replace('_', '-')}" in text
    for title in ("run:", "data and model:", "optimizer (applied by the servers"):
        assert title in text


def _help(command: str, capsys, flag: str = "--help") -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, flag])
    return capsys.readouterr().out


ROOM = {"run": None, "server": "shard", "worker": "worker"}


@pytest.mark.parametrize("command", ["run", "server", "worker"])
def test_help_shows_each_flags_default(command, capsys):
    text = _help(command, capsys)  # --help: in full (server and worker's -h is a line a flag)
    # Each flag's entry in the help: from its line to the next flag's or to its group's end.
    # (?=[ ,\n]): the flag itself, not a longer one it begins (--servers, --servers-on-stdin).
    others = not_read(ROOM[command]) if ROOM[command] else {}
    mine = [leaf for leaf in C.leaves() if leaf.name not in others]
    starts = {leaf.name: re.search(rf"^  --{leaf.name.replace('_', '-')}(?=[ ,\n])", text, re.M) for leaf in mine}
    assert all(starts.values()), [name for name, m in starts.items() if not m]
    assert not any(re.search(rf"^  --{name.replace('_', '-')}(?=[ ,\n])", text, re.M) for name in others)
    bounds = sorted(m.start() for m in starts.values()) + [text.index("\nmodes:")]
    for leaf in mine:
        begin = starts[leaf.name].start()
        entry = " ".join(text[begin:bounds[bounds.index(begin) + 1]].split("\n\n")[0].split())
        if leaf.type is bool or leaf.default in ("", ()):
            assert "(default: " not in entry, entry
        else:  # as a user types it: `auto`, not the -1 that stands for it
            shown = leaf.flag.shown if leaf.flag.shown is not None else leaf.default
            assert entry.endswith(f"(default: {shown})"), entry
    flat = " ".join(text.split())
    assert "--lr LR learning rate (default: 0.05)" in flat and "--mode {sync,async,ssp" in flat  # server: no allreduce


def test_run_help_opens_with_one_usage_line_and_dash_h_is_a_line_a_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    short = _help("run", capsys, "-h")
    assert short.startswith("usage: psgd run [--mode M --workers N --servers K ...] (-h: one line a flag, "
                            "--help: in full)\n\nTrain one model"), short[:300]
    lines = short.splitlines()
    flags = [line for line in lines if line.startswith("  -")]
    # One line a flag: none continues on the next line, and around them only the usage, the groups'
    # names and the modes (the total grows with the flags, one line each).
    assert not any(a.startswith("  -") and b.startswith("   ") for a, b in zip(lines, lines[1:], strict=False))
    assert len(flags) > 80 and len(lines) - len(flags) < 40 and all(len(line) <= 100 for line in lines)
    full = _help("run", capsys)
    assert full.splitlines()[0] == short.splitlines()[0] and len(full.splitlines()) > 2 * len(short.splitlines())
    # --eval-every's default is said once, as a user types it
    flat = " ".join(full.split())
    assert "(0: end only; auto: every 20," in flat and "(default: auto)" in flat and "the default" not in flat
    assert "(default: -1)" not in flat and re.search(r"--eval-every N\|auto +snapshot .*\[auto\]\n", short)


def test_server_dash_h_cuts_no_help_mid_phrase_and_lists_only_the_modes_it_serves(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    short = _help("server", capsys, "-h")
    lines = {ln.split()[0]: ln for ln in short.splitlines() if ln.startswith("  --")}
    assert "DC-ASGD: the shard adds" in lines["--dc-lambda"]  # not "DC-ASGD [0.0]"
    assert lines["--link"].endswith("traffic to an EMULATED link")  # not "EMULATED link,"
    assert "m * MS + (1 -" in lines["--dc-ms-decay"]  # a formula's own parenthesis stays
    for line in lines.values():
        body = re.sub(r" \[[^]]*\]$", "", line)  # the default, [x], aside
        assert not body.endswith((",", ":", ";", "(", " or", " of")), line  # a cut shows as one: "..."
        assert len(line) <= 100, line
    assert "--mode {sync,async,ssp} " in short and "allreduce  No servers" not in short
    from psgd.train import serve

    with pytest.raises(UsageError, match="--mode allreduce has no parameter servers"):  # still its one line
        serve._config(build_parser().parse_args(["server", "--shard", "0", "--mode", "allreduce"]))


def test_mode_help_points_at_the_modes_printed_below_it(capsys):
    text = _help("run", capsys)
    assert "see above" not in text
    assert text.index("(see 'modes' below)") < text.index("\nmodes:\n  sync ")


@pytest.mark.parametrize("command,does", [("server", "Serve one parameter shard"),
                                          ("worker", "Train as worker --rank")])
def test_server_and_worker_help_say_what_they_do_and_that_run_starts_them(command, does, capsys):
    text = _help(command, capsys)
    description = " ".join(text.split("\n\n")[1].split())   # usage, blank line, description
    assert description.startswith(does) and "`psgd run` starts" in description


def test_servers_count_and_allreduce():
    parser = build_parser()
    # A negative count is a count (for `run`), not a malformed HOST:PORT list.
    for bad in ("-1", "0"):
        with pytest.raises(UsageError, match=rf"^--servers must be >= 1, got {bad}$"):
            config_from_args(parser.parse_args(["run", "--servers", bad]))
    with pytest.raises(UsageError, match="--mode allreduce has no servers"):
        config_from_args(parser.parse_args(["run", "--mode", "allreduce", "--servers", "3"]))
    # The default servers=1 (said or not) is no contradiction: psgd run hands it to every worker.
    for argv in (["--mode", "allreduce"], ["--mode", "allreduce", "--servers", "1"]):
        assert config_from_args(parser.parse_args(["run", *argv])).mode == "allreduce"
    assert C.parse_servers("h1:1,h2:2") == ["h1:1", "h2:2"] and C.parse_servers("3") == 3


@dataclass(frozen=True)
class _ToySection:
    GROUP: ClassVar[str] = "toy section"
    alpha: float = C.opt(0.5, "alpha (50% of it)")


@dataclass(frozen=True)
class _Toy:
    GROUP: ClassVar[str] = "toy"
    count: int = C.opt(1, "how many")
    kind: str = C.opt("a", "which", choices=("a", "b"))
    fast: bool = C.opt(False, "go fast")
    pairs: C.Pairs = C.opt((), "rank pairs (repeatable)", metavar="RANK=N")
    section: _ToySection = field(default_factory=_ToySection)


def test_a_new_schema_needs_nothing_but_its_fields(capsys):
    parser = argparse.ArgumentParser(prog="toy")
    C.add_flags(parser, _Toy)
    argv = ["--count", "3", "--kind", "b", "--fast", "--pairs", "1=2", "--pairs", "0=7", "--alpha", "0.25"]
    toy = C.from_namespace(parser.parse_args(argv), _Toy)
    assert toy == _Toy(3, "b", True, ((1, 2), (0, 7)), _ToySection(0.25))
    assert C.to_argv(toy) == argv
    assert C.from_namespace(parser.parse_args([]), _Toy) == _Toy()
    assert C.from_dict(json.loads(json.dumps(dataclasses.asdict(toy))), _Toy) == toy
    parser.print_help()
    text = capsys.readouterr().out
    assert "toy section:" in text and "alpha (50% of it)" in text and "--pairs RANK=N" in text


def test_from_dict_refuses_unknown_and_misplaced_keys():
    for bad, name in [({"bogus": 1}, "'bogus'"), ({"data": {"bogus": 1}}, "data.bogus"),
                      ({"lr": 0.1}, "'lr'"), ({"optim": {"dataset": "mnist"}}, "optim.dataset")]:
        with pytest.raises(ValueError, match=name):
            from_dict(bad)
    assert from_dict({"straggler": [[0, 30]], "optim": {"lr": 0.1}}) == RunConfig(
        straggler=((0, 30),), optim=C.OptimConfig(lr=0.1))


def test_validation_and_epochs():
    with pytest.raises(ValueError, match="--batch-size"):
        validate(RunConfig(batch_size=0))
    cfg = with_epochs_resolved(RunConfig(epochs=2, workers=4, batch_size=10), train_size=1000)
    assert cfg.steps == 50
    with pytest.raises(ValueError, match="bogus"):
        from_dict({"bogus": 1})


def test_global_batches_split_across_workers():
    labels = torch.arange(200) % 10
    four = data.BatchPlan(labels, 4, 8, seed=1)
    one = data.BatchPlan(labels, 1, 32, seed=1)
    for step in (0, 5, 6, 13):  # 6 global batches per epoch: crosses epochs
        joined = torch.cat([four.indices(r, step) for r in range(4)])
        assert torch.equal(joined, one.indices(0, step))
    assert not torch.equal(one.indices(0, 0), one.indices(0, 6))  # a new permutation each epoch


def test_noniid_gives_each_worker_its_own_labels():
    labels = torch.arange(400) % 4
    plan = data.BatchPlan(labels, 4, 10, seed=0, noniid=True)
    for r in range(4):
        assert set(labels[plan.indices(r, 3)].tolist()) == {r}


def test_mnist1d_is_generated_offline_and_cached(tmp_path):
    cfg = DataConfig(dataset="mnist1d", num_samples=600, data_dir=str(tmp_path))
    ds = data.load(cfg)
    assert ds.x_train.shape == (480, 40) and ds.x_test.shape == (120, 40) and ds.num_classes == 10
    assert list(tmp_path.glob("mnist1d-*.npz"))
    assert torch.equal(data.load(cfg).x_train, ds.x_train)
    assert data.train_size(cfg) == 480


def test_mnist_idx_files(tmp_path):
    def write(name, arr):
        header = struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
        with gzip.open(tmp_path / (name + ".gz"), "wb") as f:
            f.write(header + arr.astype(np.uint8).tobytes())

    rng = np.random.default_rng(0)
    write("train-images-idx3-ubyte", rng.integers(0, 255, (20, 28, 28)))
    write("train-labels-idx1-ubyte", rng.integers(0, 10, 20))
    write("t10k-images-idx3-ubyte", rng.integers(0, 255, (5, 28, 28)))
    write("t10k-labels-idx1-ubyte", rng.integers(0, 10, 5))
    ds = data.load(DataConfig(dataset="mnist", data_dir=str(tmp_path)))
    assert ds.x_train.shape == (20, 784) and float(ds.x_train.max()) <= 1.0 and ds.y_test.shape == (5,)
    with pytest.raises(FileNotFoundError, match="not found"):
        data.load(DataConfig(dataset="mnist", data_dir=str(tmp_path / "missing")))


def _rows(x: torch.Tensor) -> set[tuple[float, ...]]:
    return set(map(tuple, x.tolist()))


def test_validation_split_comes_out_of_the_training_set():
    plain = data.load(DataConfig(dataset="synthetic", num_samples=1000))
    assert plain.x_val.shape == (0, 32) and plain.y_val.shape == (0,)
    cfg = DataConfig(dataset="synthetic", num_samples=1000, val_fraction=0.25)
    ds = data.load(cfg)
    assert ds.x_val.shape == (200, 32) and ds.x_train.shape == (600, 32) and data.train_size(cfg) == 600
    assert torch.equal(ds.x_test, plain.x_test) and torch.equal(ds.y_test, plain.y_test)  # test set untouched
    train, val = _rows(ds.x_train), _rows(ds.x_val)
    assert not train & val and train | val == _rows(plain.x_train)
    assert torch.equal(data.load(cfg).x_val, ds.x_val)  # the same samples every time (seeded by data_seed)
    other = data.load(DataConfig(dataset="synthetic", num_samples=1000, val_fraction=0.25, data_seed=7))
    assert _rows(other.x_val) != val
    # Labels travel with their inputs; the training samples keep their original order.
    index = {row: i for i, row in enumerate(map(tuple, plain.x_train.tolist()))}
    kept = torch.tensor([index[tuple(r)] for r in ds.x_train.tolist()])
    assert torch.equal(kept, kept.sort().values) and torch.equal(ds.y_train, plain.y_train[kept])
    one_epoch = RunConfig(epochs=1, workers=2, batch_size=10, data=cfg)
    assert with_epochs_resolved(one_epoch, data.train_size(cfg)).steps == 30  # --epochs counts 600 samples
    with pytest.raises(ValueError, match="--val-fraction 0.95 leaves none"):
        data.train_size(DataConfig(num_samples=10, val_fraction=0.95))


def test_dirichlet_alpha_sets_the_label_skew():
    labels = torch.arange(4000) % 10
    uniform = data.class_histogram(data.BatchPlan(labels, 10, 16, seed=0, dirichlet_alpha=1000.0), labels, 10)
    for counts in uniform:
        shares = torch.tensor(counts, dtype=torch.float64) / sum(counts)
        assert (shares - 0.1).abs().max() < 0.03, counts
    skewed = data.class_histogram(data.BatchPlan(labels, 10, 16, seed=0, dirichlet_alpha=0.05), labels, 10)
    top2 = sorted(sum(sorted(c)[-2:]) / sum(c) for c in skewed)
    assert top2[len(top2) // 2] > 0.8 and top2[0] > 0.5, top2  # most of a worker's samples: 1-2 classes


def test_dirichlet_parts_partition_the_data_and_each_holds_a_batch():
    labels = torch.arange(600) % 3
    parts = batches.dirichlet_parts(labels, 5, alpha=0.01, seed=4, min_size=32)  # few classes: top-ups needed
    assert all(len(p) >= 32 for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(600))
    again = batches.dirichlet_parts(labels, 5, alpha=0.01, seed=4, min_size=32)
    assert all(torch.equal(a, b) for a, b in zip(parts, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(parts, batches.dirichlet_parts(labels, 5, 0.01, seed=5,
                                                                                min_size=32), strict=True))
    with pytest.raises(ValueError, match="cannot give 5 workers a batch of 200"):
        batches.dirichlet_parts(labels, 5, alpha=1.0, seed=0, min_size=200)


def test_dirichlet_plan_cycles_each_worker_through_its_own_part():
    cfg = RunConfig(workers=3, batch_size=10, seed=2, data=DataConfig(shard_data="dirichlet", dirichlet_alpha=0.3))
    labels = torch.arange(300) % 5
    plan = data.plan_for(cfg, labels)
    for r in range(3):
        part = set(plan.parts[r].tolist())
        epoch = len(part) // 10
        seen = [plan.indices(r, t) for t in range(2 * epoch + 1)]
        assert all(set(b.tolist()) <= part and len(b) == 10 for b in seen)
        assert len(set(torch.cat(seen[:epoch]).tolist())) == 10 * epoch  # no repeat within an epoch
    hist = data.class_histogram(plan, labels, 5)
    assert [sum(h) for h in hist] == [len(p) for p in plan.parts] and sum(map(sum, hist)) == 300
    iid = data.class_histogram(data.BatchPlan(labels, 3, 10, seed=2), labels, 5)
    assert [sum(h) for h in iid] == [100, 100, 100]  # IID: what each worker sees in one epoch


def test_dirichlet_equal_parts_are_one_size_skewed_and_a_partition():
    labels = torch.arange(10).repeat_interleave(40)[torch.randperm(400, generator=torch.Generator().manual_seed(0))]
    parts = batches.dirichlet_equal_parts(labels, 4, alpha=0.1, seed=3, min_size=8)
    assert [len(p) for p in parts] == [100] * 4
    assert len(torch.cat(parts).unique()) == 400                      # every sample once: a partition
    assert all(torch.equal(a, b) for a, b in zip(parts, batches.dirichlet_equal_parts(labels, 4, 0.1, 3, 8),
                                                  strict=True))       # a pure function of its inputs
    first = torch.bincount(labels[parts[0]], minlength=10)
    assert int((first > 0).sum()) <= 5, first                          # Dir(0.1): a few classes, not all ten
    plan = data.BatchPlan(labels, 4, 8, seed=3, dirichlet_alpha=0.1, equal=True)
    assert all(len(p) == 100 for p in plan.parts)
    with pytest.raises(ValueError, match="cannot give"):
        batches.dirichlet_equal_parts(labels, 4, 0.1, 3, min_size=101)
