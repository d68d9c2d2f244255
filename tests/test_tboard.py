"""`--tensorboard DIR` (psgd/train/tboard.py): a run's curves, read back with TensorBoard's own reader."""

from __future__ import annotations

import pytest

from tests.helpers import psgd_main, summary


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_run_writes_its_curves_and_summarize_writes_them_again(tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--steps", "30", "--eval-every", "10", "--dataset",
                  "synthetic", "--num-samples", "600", "--batch-size", "8", "--out", str(out), "--quiet",
                  "--tensorboard", str(tb))
    assert r.returncode == 0, r.stderr
    got = scalars(tb)
    assert {"train/loss", "eval/test_loss", "eval/test_accuracy", "step/compute_ms", "run/staleness_mean",
            "run/samples_per_s"} <= set(got)
    assert [step for step, _ in got["train/loss"]] == list(range(30)), "one point per clock"
    s = summary(out)
    assert got["run/samples_per_s"][0][1] == pytest.approx(s["samples_per_s"], rel=1e-6)
    assert got["eval/test_loss"][-1][1] == pytest.approx(s["final_test_loss"], rel=1e-6)
    again = tmp_path / "tb2"
    assert psgd_main("summarize", str(out), "--quiet", "--tensorboard", str(again)).returncode == 0
    assert scalars(again)["train/loss"] == got["train/loss"]


def test_without_tensorboard_it_is_one_line_and_exit_2(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tensorboard(name, *args, **kw):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    r = psgd_main("run", "--steps", "2", "--out", str(tmp_path / "never"), "--tensorboard", str(tmp_path / "tb"))
    assert r.returncode == 2 and "pip install 'psgd[tensorboard]'" in r.stderr
    assert not (tmp_path / "never").exists()
