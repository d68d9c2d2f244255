"""DC-ASGD-a, the adaptive delay compensation (psgd/core/staleness.py `dc_adaptive_scale`, applied by
psgd/ps/remedies.py `DCASGD(adaptive=True)`): the arithmetic against a hand computation on tiny
tensors, through a real shard, and the flags' refusals; and E12's verdict (psgd/lab/analyses_remedies.py)
on synthetic per-seed finals, which must be able to come out either way."""

from __future__ import annotations

import math

import pytest
import torch

from psgd.core import staleness
from psgd.core.config import OptimConfig, RunConfig
from psgd.lab import analyses_remedies as R
from psgd.lab.results import Group, RunData
from psgd.train import assemble
from tests.helpers import psgd_main
from tests.test_staleness import pull_first

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")


def test_adaptive_scale_is_one_over_the_root_of_a_moving_mean_square():
    """m = 0.75: MS = 0.75 MS + 0.25 g^2, from 0, then from the first; the scale is 1 / (sqrt(MS) + eps)."""
    ms = torch.zeros(3)
    g1, g2 = torch.tensor([4.0, 0.0, -2.0]), torch.tensor([2.0, 0.0, 2.0])
    scale = staleness.dc_adaptive_scale(ms, g1, 0.75)
    assert ms.tolist() == [4.0, 0.0, 1.0]                      # 0.25 * (16, 0, 4)
    assert scale.tolist() == pytest.approx([1 / (2 + 1e-7), 1 / 1e-7, 1 / (1 + 1e-7)], rel=1e-6)
    scale = staleness.dc_adaptive_scale(ms, g2, 0.75)
    assert ms.tolist() == [4.0, 0.0, 1.75]                     # 0.75 * (4, 0, 1) + 0.25 * (4, 0, 4)
    assert scale.tolist() == pytest.approx([1 / (2 + 1e-7), 1 / 1e-7, 1 / (math.sqrt(1.75) + 1e-7)], rel=1e-6)
    # Where every gradient was 0 the term lam g g (w_now - w_then) is 0: times the scale it stays 0, not NaN.
    term = staleness.dc_term(g2, torch.ones(3), torch.zeros(3), 2.0, torch.empty(3)) * scale
    assert torch.isfinite(term).all() and term[1] == 0


def test_dc_asgd_a_on_a_shard_matches_a_hand_computation():
    """Two workers pull version 0; worker 1 pushes first (staleness 0: nothing to compensate, but
    its gradient enters the mean square), then worker 0 (staleness 1). Plain SGD, lr 0.5."""
    lr, lam0, m = 0.5, 2.0, 0.5
    cfg = RunConfig(mode="async", workers=2, servers=1, steps=10, dc_lambda=lam0, dc_adaptive=True, dc_ms_decay=m,
                    optim=OptimConfig(lr=lr, momentum=0.0))
    s = assemble.shard(cfg, 0)
    w0 = [1.0, -1.0, 0.5, 2.0]
    s.init(torch.tensor(w0))
    pull_first(s, 2, "fp32")
    g1, g0 = [1.0, 2.0, 0.0, -1.0], [0.5, -1.0, 2.0, 1.0]
    assert s.push(1, 0, 0, torch.tensor(g1), "fp32").staleness == 0
    w1 = [w - lr * g for w, g in zip(w0, g1, strict=True)]
    assert torch.allclose(s.param, torch.tensor(w1), rtol=0, atol=1e-6)
    ms = [(1 - m) * g * g for g in g1]
    ms = [m * a + (1 - m) * g * g for a, g in zip(ms, g0, strict=True)]
    applied = [g + lam0 * g * g * (wn - wt) / (math.sqrt(a) + staleness.DC_EPS)
               for g, wn, wt, a in zip(g0, w1, w0, ms, strict=True)]
    out = s.push(0, 0, 0, torch.tensor(g0), "fp32")
    assert out.staleness == 1 and out.applied
    w2 = [w - lr * a for w, a in zip(w1, applied, strict=True)]
    assert torch.allclose(s.param, torch.tensor(w2), rtol=0, atol=1e-5), (s.param, w2)
    # The constant variant with the same lambda compensates differently (no 1 / sqrt(MS)).
    const = [g + lam0 * g * g * (wn - wt) for g, wn, wt in zip(g0, w1, w0, strict=True)]
    assert max(abs(a - c) for a, c in zip(applied, const, strict=True)) > 0.1
    (dc,) = s.remedies
    assert dc.adaptive and torch.allclose(dc.mean_square, torch.tensor(ms))


@pytest.mark.parametrize("flags,message", [
    (["--mode", "async", "--dc-adaptive"], "--dc-adaptive scales --dc-lambda: give --dc-lambda > 0"),
    (["--mode", "async", "--dc-lambda", "1", "--dc-adaptive", "--dc-ms-decay", "1"], "--dc-ms-decay must be in"),
    (["--mode", "async", "--dc-lambda", "1", "--dc-ms-decay", "-0.1"], "--dc-ms-decay must be in"),
])
def test_bad_dc_adaptive_flags_are_a_one_line_usage_error(flags, message):
    r = psgd_main("run", *flags)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- E12's verdict (psgd/lab/analyses_remedies.py) on synthetic per-seed finals ----------------------
def group(label: str, accs: list[float], *, workers: int = 4, lr: float = 0.03, mode: str = "async",
          scale: float | None = None, **cfg) -> Group:
    """Seeds 0.. of one arm whose final test accuracy (the mean of its last 3 evaluations) is `accs`."""
    runs = []
    for seed, acc in enumerate(accs):
        config = {"mode": mode, "workers": workers, "seed": seed, "optim": {"lr": lr, "momentum": 0.9}, **cfg}
        summary = {"config": config, "mode": mode, "staleness": {"mean": 3.0},
                   "remedies": None if scale is None else {"mean_step_scale": scale}}
        runs.append(RunData(summary, [{"version": v, "test_accuracy": acc, "train_loss": 1.0} for v in range(3)]))
    return Group(label, runs)


PLAIN = [0.55, 0.555, 0.56]


def plus(d: list[float]) -> list[float]:
    return [p + x for p, x in zip(PLAIN, d, strict=True)]


def e12_verdict(dc10: list[float], dc100: list[float], sa: list[float], control: list[float] | None = None,
                sa_scale: float = 0.45):
    groups = [group("control", control or plus([0.05, 0.055, 0.06]), workers=1),
              group("plain", PLAIN), group("plain 0.1", [0.2, 0.25, 0.3], lr=0.1),
              group("dc10", plus(dc10), dc_lambda=10.0), group("dc100", plus(dc100), dc_lambda=100.0),
              group("sa", plus(sa), lr=0.067, staleness_lr=True, scale=sa_scale)]
    cell = {(R.arm(g), g.cfg["workers"], g.lr): g for g in groups}
    cells = R._cells(cell)
    primary = R._primary(cells)
    grid = {lr: g for (a, n, lr), g in cell.items() if a == R.PLAIN and n == 4}
    return primary, R._verdict(primary, grid, 0.02)[0]


def test_e12_verdict_comes_out_either_way_from_paired_differences():
    none, gain = [0.001, -0.001, 0.0], [0.04, 0.045, 0.05]
    primary, v = e12_verdict(none, [0.0, 0.001, -0.001], gain)
    assert primary.lr == 0.03 and set(primary.arms) == {"DC-ASGD λ=10", "DC-ASGD λ=100",
                                                        "staleness-aware rate at lr 0.067"}
    assert v.outcome == "depends" and "DC-ASGD refuted" in v.reason and "staleness-aware rate confirmed" in v.reason
    assert "97.5% intervals" in v.reason  # Bonferroni over DC's two settings
    _, v = e12_verdict(none, [0.05, 0.052, 0.054], gain)
    assert v.outcome == "confirmed" and "best of 2 settings DC-ASGD λ=100" in v.reason
    _, v = e12_verdict(none, none, [-0.01, 0.0, -0.005])
    assert v.outcome == "refuted"
    # A gain within the seeds' noise: neither.
    _, v = e12_verdict(none, none, [0.06, -0.03, 0.02])
    assert v.outcome == "inconclusive" and "staleness-aware rate inconclusive" in v.reason
    # Nothing stale costs accuracy: nothing to close.
    _, v = e12_verdict(none, none, gain, control=PLAIN)
    assert v.outcome == "inconclusive" and "no measured gap for a remedy to close" in v.reason
    # A staleness-aware step that does not match plain async's mean step is shown, not judged.
    _, v = e12_verdict(none, none, gain, sa_scale=0.64)
    assert v.outcome == "refuted" and "not judged: its mean step is 1.43x" in v.reason
