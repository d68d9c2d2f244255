"""A parameter server on Ray actors, after Ray's own parameter-server example.

Optional: `psgd bench peers` uses it only when `import ray` works (`pip install 'psgd[peers]'`,
Ray 2.60 here) and a private network namespace can be made for it (see ISOLATE), and otherwise
says why it skipped it. No test runs it (CI has no Ray); run by hand here, its sync run ended
with psgd's final parameters bit for bit (`psgd bench peers --widths 16 --configs sync2`).

The pattern (Ray's docs, "Parameter Server" example), in this project's words: a
`ParameterServer` actor holds the model and a torch SGD; `Trainer` actors compute gradients for
the weights they are handed.
- sync: each step the driver asks all N trainers for gradients on the current weights and hands
  the N object refs to the server, which applies their mean and returns the new weights; the refs
  chain the calls, so the driver never waits between steps.
- async: the driver takes whichever gradient is ready first (`ray.wait`), the server applies it
  alone, and that trainer gets the new weights for its next step.
Same workload as psgd/bench/rpc_peer.py: psgd's model, seeded init, data and batch plan; budget
`steps` updates (sync) or `steps x N` gradients (async); one discarded warm-up gradient per
trainer; the clock runs from after that warm-up round to the last update. Ray's processes are
started and stopped here (`ray.init` / `ray.shutdown`) on 127.0.0.1.

    python -c 'import sys; from psgd.bench.ray_peer import main; sys.exit(main(sys.argv[1:]))' \\
        --config OUT/config.json
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from psgd.core.config import from_dict
from psgd.train import data as data_mod
from psgd.train import evaluate, lifeline, models
from psgd.train.metrics import process_start_time

# On start Ray looks for the machine's address and cloud (a UDP connect to 8.8.8.8, DNS queries, HTTP
# to 169.254.169.254: seen with strace), and reports usage unless told not to. Nothing of that may
# leave this machine, so the driver and every process Ray starts run in a network namespace of their
# own with only loopback up: those attempts fail there at once (ENETUNREACH), loopback works as usual.
ISOLATE = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


def skip_reason() -> str | None:
    """Why Ray cannot run here (None: it can): not installed, or no private network namespace."""
    if importlib.util.find_spec("ray") is None:  # without importing it: that takes seconds
        return "ray not installed (pip install 'psgd[peers]')"
    if not (shutil.which("unshare") and shutil.which("ip")):
        return "Ray runs here only in a private network namespace (unshare -n, ip), which this host lacks"
    probe = subprocess.run(ISOLATE + ["true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        return ("Ray runs here only in a private network namespace (it contacts 8.8.8.8, the DNS resolver and "
                "169.254.169.254 on start); unshare -n needs root or CAP_SYS_ADMIN")
    return None


class ParameterServer:
    """The model and its SGD (a Ray actor: one method runs at a time, so no lock)."""

    def __init__(self, cfg_dict: dict) -> None:
        torch.set_num_threads(1)
        cfg = from_dict(cfg_dict)
        ds = data_mod.load(cfg.data)
        self.model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=cfg.optim.lr, momentum=cfg.optim.momentum)
        self.updates = 0

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def apply(self, *grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """One update with the mean of the gradients given (sync: N of them, async: one)."""
        for i, p in enumerate(self.params):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total.add_(g[i])
            p.grad = total.div_(len(grads))
        self.opt.step()
        self.updates += 1
        return self.weights()

    def final(self) -> torch.Tensor:
        return torch.nn.utils.parameters_to_vector(self.params).detach().clone()


class Trainer:
    """Gradients of worker `rank`'s batch at its own clock, for the weights handed in."""

    def __init__(self, cfg_dict: dict, rank: int) -> None:
        torch.set_num_threads(1)
        cfg = from_dict(cfg_dict)
        self.ds = data_mod.load(cfg.data)
        self.plan = data_mod.plan_for(cfg, self.ds.y_train)
        self.model = models.build(cfg.model, self.ds.input_dim, self.ds.num_classes, cfg.seed)
        self.rank, self.clock = rank, 0

    def _grads(self, weights: list[torch.Tensor], clock: int) -> list[torch.Tensor]:
        with torch.no_grad():
            for p, w in zip(self.model.parameters(), weights, strict=True):
                p.copy_(w)
        self.model.zero_grad()
        idx = self.plan.indices(self.rank, clock)
        F.cross_entropy(self.model(self.ds.x_train[idx]), self.ds.y_train[idx]).backward()
        return [p.grad.clone() for p in self.model.parameters()]

    def warm_up(self, weights: list[torch.Tensor]) -> bool:
        self._grads(weights, 0)  # discarded; the clock does not move
        return True

    def gradients(self, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        self.clock += 1
        return self._grads(weights, self.clock - 1)


def run(cfg_dict: dict, out: Path) -> dict:
    import ray

    cfg = from_dict(cfg_dict)
    n = cfg.workers
    # Logical CPUs: every actor reserves one to be scheduled, and N + 1 of them must fit even on 2 cores.
    ray.init(num_cpus=n + 1, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        ps = ray.remote(ParameterServer).remote(cfg_dict)
        trainers = [ray.remote(Trainer).remote(cfg_dict, r) for r in range(n)]
        w = ps.weights.remote()
        ray.get([t.warm_up.remote(w) for t in trainers])
        start = time.time()
        if cfg.mode == "sync":
            for _ in range(cfg.steps):
                w = ps.apply.remote(*[t.gradients.remote(w) for t in trainers])
        else:
            pending = {t.gradients.remote(w): t for t in trainers}
            for _ in range(cfg.steps * n):
                (ready,), _ = ray.wait(list(pending), num_returns=1)
                trainer = pending.pop(ready)
                w = ps.apply.remote(ready)
                pending[trainer.gradients.remote(w)] = trainer
        ray.get(w)
        wall = time.time() - start
        updates = cfg.steps if cfg.mode == "sync" else cfg.steps * n
        final = ray.get(ps.final.remote())
    finally:
        ray.shutdown()
    torch.save(final, out / "final_params.pt")
    ds = data_mod.load(cfg.data)
    model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    train_loss, _ = evaluate.evaluate(model, final, ds.x_train[:10_000], ds.y_train[:10_000])
    result = {"system": "ray", "mode": cfg.mode, "workers": n, "params": final.numel(), "global_updates": updates,
              "worker_steps": updates * (n if cfg.mode == "sync" else 1), "wall_time_s": wall,
              "updates_per_s": updates / wall if wall > 0 else 0.0, "startup_s": start - process_start_time(),
              "train_start": start,
              "final_train_loss": train_loss}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str]) -> int:
    lifeline.die_with_launcher()  # started by `psgd bench peers`: die with it (Ray's processes follow)
    if len(argv) != 2 or argv[0] != "--config":
        print("usage: ray_peer --config OUT/config.json", file=sys.stderr)
        return 2
    path = Path(argv[1])
    run(json.loads(path.read_text()), path.parent)
    return 0
