"""Remedies for stale gradients as pieces a shard is given: the staleness-aware rate and DC-ASGD.

Contract: a remedy has `adjust(shard, grad, worker, tau) -> Tensor | None` (the gradient to take
instead of `grad`, computed on the shard's parameters now; None: skip it, counted like a
non-finite gradient; ShardError: refuse the push, nothing changed), `pulled(shard, worker, snap)`
(a pull of `worker` was served from snapshot `snap`) and `forget(shard, worker)` (the worker is
gone). The shard calls them under its one lock, in the order given, after the policy accepted the
push and measured its staleness tau, before the gradient is buffered or applied
(psgd/core/consistency.py `adjust`): so a remedy is written once for every transport, PushPull
and --separate-pull, --overlap and every wire dtype. Each adds its figures to `shard.remedy`
(summary.json's `remedies`). With tau <= 1 and no DC they do no arithmetic: a run with nothing
stale is bit for bit a plain run. The arithmetic itself is psgd/core/staleness.py.

- `StalenessLR` (Zhang et al. 2016, "Staleness-aware async-SGD"): g / max(1, tau).
- `DCASGD(lam)` (Zheng et al. 2017, DC-ASGD-c): g + lam g (.) g (.) (w_now - w_then), w_then the
  snapshot the worker pulled last (lent to it from its pull to its push: no copy of its own).
- `DCASGD(lam, adaptive=True, ms_decay=m)` (the same paper's DC-ASGD-a): lambda per coordinate
  lam / sqrt(MeanSquare), MeanSquare = m MeanSquare + (1 - m) g (.) g over the gradients this
  shard received (psgd/core/staleness.py `dc_adaptive_scale`): one more fp32 per parameter on the
  shard, not checkpointed (a restored shard starts it at 0 again, as a fresh run does).
"""

from __future__ import annotations

import torch

from psgd.core import staleness
from psgd.core.errors import Code, ShardError
from psgd.ps.shard import all_finite


class StalenessLR:
    scales = True  # reports its step scale (summary.json's mean_step_scale); without it, 1 per gradient

    def adjust(self, shard, grad: torch.Tensor, worker: int, tau: int) -> torch.Tensor | None:
        shard.remedy["step_scale_sum"] += staleness.step_scale(tau)
        if tau <= 1:
            return grad
        return torch.div(grad, tau, out=shard.scratch())

    def pulled(self, shard, worker: int, snap) -> None:
        pass

    def forget(self, shard, worker: int) -> None:
        pass


class DCASGD:
    def __init__(self, lam: float, skip_nonfinite: bool = False, adaptive: bool = False,
                 ms_decay: float = 0.95) -> None:
        assert lam > 0, "DC-ASGD with lambda 0 is no remedy: leave it out"
        assert 0 <= ms_decay < 1, f"DC-ASGD-a's mean-square decay must be in [0, 1), got {ms_decay}"
        self.lam, self.skip_nonfinite = lam, skip_nonfinite
        self.adaptive, self.ms_decay = adaptive, ms_decay
        self.mean_square: torch.Tensor | None = None   # DC-ASGD-a: made at the first push (the shard's length)
        self.then: dict = {}   # worker -> the snapshot it pulled last, lent to it until its push

    def adjust(self, shard, grad: torch.Tensor, worker: int, tau: int) -> torch.Tensor | None:
        """A compensated gradient that overflowed (a diverging run's w_now - w_then) is treated like
        a non-finite push: skipped with skip_nonfinite (None), else refused."""
        then = self.then.get(worker)
        base = shard.policy.version - tau
        if then is None or then.version != base:
            raise ShardError(Code.FAILED_PRECONDITION,
                             f"DC-ASGD on shard {shard.index}: worker {worker} pushed a gradient of version {base} "
                             f"but last pulled {'nothing' if then is None else then.version} here")
        out = staleness.dc_term(grad, shard.param.detach(), then.values, self.lam, shard.scratch())
        if self.adaptive:
            if self.mean_square is None:
                self.mean_square = torch.zeros_like(grad, dtype=torch.float32)
            # A gradient that is not finite would poison the average for good: it is left out of it.
            if all_finite(grad):
                out.mul_(staleness.dc_adaptive_scale(self.mean_square, grad, self.ms_decay))
        # How large the compensation is next to the gradient: what the remedy did, in summary.json.
        relative = float(torch.linalg.vector_norm(out) / torch.linalg.vector_norm(grad).clamp_min(1e-30))
        out.add_(grad)
        finite = all_finite(out)
        if not finite and not self.skip_nonfinite:
            raise ShardError(Code.INVALID_ARGUMENT,
                             f"DC-ASGD on shard {shard.index}: the compensated gradient of worker {worker} is not "
                             "finite (run servers with --skip-nonfinite to skip such gradients)")
        del self.then[worker]   # used: this worker's next gradient comes from its next pull
        shard.release(then)
        if not finite:
            return None
        shard.remedy["dc_relative_sum"] += relative
        return out

    def pulled(self, shard, worker: int, snap) -> None:
        """Keep `snap` (what `worker` just pulled) lent to it until its push."""
        snap.lent += 1
        previous = self.then.get(worker)
        self.then[worker] = snap
        if previous is not None:  # pulled again without pushing (a retried pull): the new one counts
            shard.release(previous)
        held = {id(t): t.values for t in self.then.values()}  # workers on one version share its copy
        shard.remedy["dc_then_peak_bytes"] = max(shard.remedy["dc_then_peak_bytes"],
                                                 sum(v.numel() * v.element_size() for v in held.values()))

    def forget(self, shard, worker: int) -> None:
        if worker in self.then:
            shard.release(self.then.pop(worker))
