"""What a shard keeps: checkpoints, its stats and its snapshots (the `Persistence` part of `psgd.ps.shard.Shard`).

- Checkpoints (--checkpoint-every K): `state()` is taken under the lock right after an update (a
  consistent cut), written by the pushing thread once the lock is free (`_write_pending`, through
  psgd/ps/checkpoint.py) before that push is answered; `restore(state)` starts a shard from one
  (`psgd server --restore`) instead of a worker's Init. A `companion` (the rows served beside the
  shard) adds its own state to each checkpoint, in the same cut.
- Snapshots of the parameters every `--eval-every` updates (and at 0 and the end) are saved by
  `save(out)` with the stats and evaluated after the run, so evaluation never disturbs timing.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from psgd.ps import checkpoint


class Persistence:
    """The Shard's checkpoints and its end of a run (the attributes are made by `Shard.__init__`)."""

    # What else this shard's checkpoints hold, under "rows": the embedding rows served beside it
    # (psgd/train/rowshard.py sets it), taken in the same cut as the parameters. None: nothing.
    companion: Any = None

    # -- checkpoints --------------------------------------------------------------------------
    def state(self) -> dict:
        """Everything a restored shard needs to go on as if nothing happened (lock held): the
        parameters, the optimizer's state (momentum), the warmup schedule, version, clocks."""
        clocks, accepted = list(self.policy.clocks), self.policy.accepted
        if self.policy.pushing is not None:  # inside a push's apply: count that push as the policy will
            worker, clock = self.policy.pushing
            clocks[worker], accepted = clock + 1, accepted + 1
        return {"shard": self.index, "mode": self.options.mode, "workers": self.workers,
                "version": self.policy.version, "accepted": accepted,
                "clocks": clocks, "param": self.param.detach().clone(),
                "opt": self.opt.state_dict(), "membership": self.policy.membership_state(),
                **({"rows": self.companion.state()} if self.companion is not None else {})}

    def _write_pending(self) -> None:
        with self.lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            started = time.perf_counter()
            try:
                checkpoint.write(Path(self.options.checkpoint_dir), self.index, pending["version"], pending)
            except OSError as e:  # the update stands; a missing checkpoint is said, not fatal
                print(f"shard {self.index}: warning: checkpoint of version {pending['version']} not written: {e}",
                      file=sys.stderr, flush=True)
                return
            with self.lock:
                self.checkpoint_s += time.perf_counter() - started
                self.checkpoints += 1

    def restore(self, state: dict) -> None:
        """Start from a checkpoint instead of a worker's Init (`psgd server --restore`): the
        shard is initialised at the checkpoint's version, with its clocks, and no start barrier."""
        want = (self.index, self.options.mode, self.workers)
        got = (state["shard"], state["mode"], state["workers"])
        if got != want:
            raise ValueError(f"the checkpoint is shard {got[0]} of a {got[1]} run with {got[2]} workers; "
                             f"this server is shard {want[0]} of a {want[1]} run with {want[2]} workers")
        if self.expected is not None and state["param"].numel() != self.expected:
            raise ValueError(f"the checkpoint holds {state['param'].numel()} elements; this model's shard "
                             f"{self.index} has {self.expected}")
        param = state["param"].clone()
        opt = self._make_optimizer(param)
        opt.load_state_dict(state.get("opt"))  # ValueError for another optimizer's state: before anything changes
        self.init(param, opt)
        with self.lock:
            p = self.policy
            p.version, p.accepted, p.clocks[:] = state["version"], state["accepted"], state["clocks"]
            p.roster.started = True  # the workers of a resumed run start at their clocks, not at 0
        if "membership" in state:  # who was in the run at that version (elastic runs, departures)
            self.policy.restore_membership(state["membership"])
        with self.lock:
            self.snapshots = [(p.version, time.time(), self.param.detach().clone())]
            self.restored_from = state["version"]

    # -- the end of a run ------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.policy.stats
        with self.lock:
            return {
                "shard": self.index, "version": self.policy.version, "accepted": self.policy.accepted,
                "staleness_hist": {str(k): v for k, v in sorted(s.staleness.items())},
                "clock_gap_hist": {str(k): v for k, v in sorted(s.gaps.items())},
                "max_clock_gap": s.max_clock_gap, "skipped_nonfinite": s.skipped_nonfinite,
                "refused_after_budget": s.refused_after_budget, "bytes_in": self.bytes_in,
                "lost_workers": {str(w): c for w, c in sorted(s.lost.items())},
                "departed_workers": {str(w): c for w, c in sorted(s.departed.items())},
                "membership": list(s.membership), "members_at_start": self.policy.members,
                "rejoined": {str(w): n for w, n in sorted(s.rejoined.items())},
                "checkpoints": self.checkpoints, "checkpoint_s": self.checkpoint_s,
                "restored_from": self.restored_from,
                "dropped_gradients": sum(s.dropped.values()),
                "dropped_per_worker": {str(w): n for w, n in sorted(s.dropped.items())},
                "bytes_out": self.bytes_out, "apply_s": self.apply_s, "num_elements": self.num_elements,
                "remedy": dict(self.remedy), "copies_on_write": self.copies_on_write,
                "params_homed": bool(self._homes),  # kept in the one worker's memory (snapshots.py `home`)
                # fp32 shard-sized buffers ever made for gradients (receive pool + a sync step's sum)
                "gradient_buffers": self.allocated.get(torch.float32, 0) + getattr(
                    getattr(self.policy, "step", None), "allocated", 0),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }

    def save(self, out: Path) -> None:
        """Write shard-K.json (stats) and shard-K.pt (snapshots incl. the final parameters)."""
        with self.lock:
            snaps = list(self.snapshots)
            if self.param is not None and (not snaps or snaps[-1][0] != self.policy.version):
                snaps.append((self.policy.version, time.time(), self.param.detach().clone()))
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"shard": self.index, "snapshots": snaps}, out / f"shard-{self.index}.pt")
        (out / f"shard-{self.index}.json").write_text(json.dumps(self.stats(), indent=1))
