"""Remedies for stale gradients, as pure arithmetic: the staleness-aware step and delay compensation.

A gradient g pushed to an async / SSP shard was computed on the parameters w_then of the version
its worker pulled; by the time it is applied the shard holds w_now, tau updates later (tau = the
gradient's staleness). The shard (psgd/ps/shard.py) corrects g with these functions before its
optimizer step, under its lock, so every transport gets the same remedy:

- Staleness-aware rate (Zhang et al. 2016, "Staleness-aware async-SGD for distributed deep
  learning", IJCAI): the step of a gradient of staleness tau is divided by max(1, tau).
  `--staleness-lr`. We scale the GRADIENT, not the optimizer's rate: with momentum the update is
  w -= lr * buf, buf = mu * buf + g, so dividing lr would also shrink every earlier (fresher)
  gradient still in the momentum buffer, while dividing g shrinks this gradient's whole
  contribution, now and as it decays through the buffer, and nothing else. With momentum 0 the
  two are the same. Weight decay is added by the optimizer to the scaled g and is not scaled:
  it is computed on w_now, which is not stale.
- DC-ASGD (Zheng et al. 2017, "Asynchronous stochastic gradient descent with delay compensation",
  ICML), the constant-lambda variant DC-ASGD-c: g(w_now) ~ g(w_then) + H (w_now - w_then), the
  Hessian H approximated by lambda * g (.) g (the outer-product approximation, its diagonal), so
  the applied gradient is g + lambda * g * g * (w_now - w_then). `--dc-lambda LAMBDA`.
  When both are on, the compensated gradient is then scaled.
- DC-ASGD-a, the adaptive variant of the same paper: lambda_t = lambda_0 / sqrt(MeanSquare(t)),
  per coordinate, with MeanSquare(t) = m MeanSquare(t-1) + (1 - m) g_t (.) g_t a moving average
  of the squared gradients the shard received (RMSProp's, Tieleman & Hinton 2012), so the term
  becomes lambda_0 g (.) g (.) (w_now - w_then) / sqrt(MeanSquare): large where the gradient is
  large compared with its own history. `--dc-lambda LAMBDA_0 --dc-adaptive --dc-ms-decay m`
  (the paper's CIFAR-10 runs: lambda_0 = 2, m = 0.95; their DC-ASGD-c used lambda = 0.04). The
  paper gives no epsilon; `DC_EPS` keeps a coordinate whose gradients were all 0 at 0 (0/eps),
  not NaN (0/0). MeanSquare includes the gradient being compensated (updated first), and starts
  at 0, as RMSProp's does.

tau <= 1 scales by 1 and lambda = 0 adds nothing: the shard then skips the arithmetic, so a run
with a remedy that has nothing to do is bit for bit a plain run.

The implicit momentum of asynchrony (Mitliagkas et al. 2016, "Asynchrony begets momentum, with an
application to deep learning", Allerton), for the report of E12: with N workers whose compute
times are exponential and independent, the next update comes from each worker with probability
1/N, so staleness is geometric with mean N - 1, and the expected async SGD step is a momentum
step with mu_implicit = 1 - 1/N (and rate lr / N). `effective_momentum` combines it with the
optimizer's explicit momentum mu by matching the mean delay of a gradient's influence: momentum
mu delays it by mu / (1 - mu) updates on average, staleness by mean_tau, and a single momentum
with the same mean delay is mu_eff = 1 - 1 / (1 / (1 - mu) + mean_tau). With mu = 0 and the
model's mean_tau = N - 1 it is Mitliagkas' 1 - 1/N. An approximation for reading the map, not a
property of the run: real compute times are not exponential, and two first-order filters in a
row are not one.

Pure: torch arithmetic only, no state, no I/O.
"""

from __future__ import annotations

import torch


def step_scale(staleness: int) -> float:
    """The staleness-aware factor of a gradient's step: 1 / max(1, tau)."""
    assert staleness >= 0, f"staleness is never negative, got {staleness}"
    return 1.0 / max(1, staleness)


def dc_term(grad: torch.Tensor, w_now: torch.Tensor, w_then: torch.Tensor, lam: float,
            out: torch.Tensor) -> torch.Tensor:
    """DC-ASGD's delay-compensation term: out = lam * grad * grad * (w_now - w_then); returns out.
    The compensated gradient is grad + out (the caller adds it, after measuring the term).

    `w_then` may be in a wire dtype (fp16, bf16: what the worker received); it is widened to
    fp32. `out` (fp32, the shard's length) must not alias grad or w_now.
    """
    torch.sub(w_now, w_then, out=out)          # w_now - w_then, in fp32
    return out.mul_(grad).mul_(grad).mul_(lam)


DC_EPS = 1e-7


def dc_adaptive_scale(mean_square: torch.Tensor, grad: torch.Tensor, decay: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """DC-ASGD-a's per-coordinate 1 / (sqrt(MeanSquare(t)) + DC_EPS), after updating `mean_square`
    in place to m MeanSquare(t-1) + (1 - m) grad (.) grad (m = `decay`); returns the scale (in
    `out` when given). The term is then dc_term(...) * scale."""
    assert 0 <= decay < 1, f"the mean square's decay must be in [0, 1), got {decay}"
    mean_square.mul_(decay).addcmul_(grad, grad, value=1.0 - decay)
    out = torch.sqrt(mean_square, out=out) if out is not None else torch.sqrt(mean_square)
    return out.add_(DC_EPS).reciprocal_()


def effective_momentum(momentum: float, mean_staleness: float) -> float:
    """Explicit momentum and the implicit momentum of staleness as one figure (module docstring)."""
    assert 0 <= momentum < 1 and mean_staleness >= 0
    return 1.0 - 1.0 / (1.0 / (1.0 - momentum) + mean_staleness)


def implicit_momentum(workers: int) -> float:
    """Mitliagkas et al.'s implicit momentum of async SGD with N workers: 1 - 1/N."""
    assert workers >= 1
    return 1.0 - 1.0 / workers
