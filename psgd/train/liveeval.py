"""`psgd run --tensorboard DIR --live-eval`: the run's checkpoints evaluated while it trains, in a process of its own.

Contract: `python -m psgd.train.liveeval OUT` (the TensorBoard follower starts it, psgd/train/tboard.py;
it runs at nice +10 and on one thread) evaluates each checkpoint version that every shard of the run in OUT
has written (OUT/checkpoints, psgd/ps/checkpoint.py: loaded only when intact, a version some shard
has pruned meanwhile skipped), once, oldest first, and appends one `eval` line per version to
OUT/eval-live.jsonl: version, samples (version x samples per update, the x the run's own evaluation
gives it), time, and the losses and accuracies psgd/train/finish.py's `_evaluate` gives. It looks
again every POLL_S and stops after the pass in which the shards had stopped (their shard-K.pt
written: training ended, and the run's own evaluation of its snapshots fills in the rest) or its
stdin closed (the follower's close). Exit 0; 2 for a folder that is not
a parameter-server run with dense parameters.

Why checkpoints: the shards write them anyway (--checkpoint-every), atomically, while the run trains,
and a second process reads them without touching the run. The snapshots summary.json is made of
stay in the shards' memory until the end, so that by default evaluation never disturbs timing; this
process does take CPU from the run, which is why it is asked for, not on by default.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from pathlib import Path

POLL_S = 0.5
FILE = "eval-live.jsonl"


def unfit(cfg) -> str | None:
    """Why a run cannot be evaluated live (a one-line usage error), or None."""
    if cfg.mode == "allreduce":
        return "--live-eval reads the shards' checkpoints: a parameter-server --mode"
    if not cfg.checkpoint_every:
        return "--live-eval evaluates the checkpoints as they are written: give --checkpoint-every K"
    if cfg.embeddings != "dense":
        return "--live-eval evaluates dense parameters: not with --embeddings rows or hybrid"
    return None


def common_versions(folder: Path, shards: int) -> list[int]:
    """Checkpoint versions every shard has a file of, by name (psgd/ps/checkpoint.py's), oldest first."""
    from psgd.ps import checkpoint  # noqa: PLC0415

    held = [set() for _ in range(shards)]
    for p in folder.glob("shard-*-v*.ckpt") if folder.is_dir() else ():
        m = checkpoint.NAME.fullmatch(p.name)
        if m and int(m.group(1)) < shards:
            held[int(m.group(1))].add(int(m.group(2)))
    return sorted(set.intersection(*held)) if held else []


def params_at(folder: Path, shards: int, version: int):
    """The full parameter vector at `version`, or None when a shard's checkpoint of it is gone or damaged."""
    import torch  # noqa: PLC0415

    from psgd.ps import checkpoint  # noqa: PLC0415

    parts = []
    for k in range(shards):
        found = checkpoint.newest(folder, k, upto=version, warn=lambda _: None)
        if found is None or found[0]["version"] != version:
            return None
        parts.append(found[0]["param"])
    return torch.cat(parts)


def follow(out: Path, stopped) -> None:
    """Evaluate each new version until `stopped(seconds)` says so (it waits up to that long)."""
    import torch  # noqa: PLC0415

    from psgd.core.config import from_dict  # noqa: PLC0415
    from psgd.train import data, finish, models  # noqa: PLC0415
    from psgd.train.metrics import samples_per_update  # noqa: PLC0415

    torch.set_num_threads(1)
    cfg = from_dict(json.loads((out / "config.json").read_text()))
    ds = data.load(cfg.data)
    model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    folder, done = out / "checkpoints", set()
    with open(out / FILE, "a") as f:
        while True:
            for v in [v for v in common_versions(folder, cfg.servers) if v not in done]:
                params = params_at(folder, cfg.servers, v)
                done.add(v)
                if params is not None:
                    e = dict(event="eval", version=v, samples=v * samples_per_update(cfg), time=time.time(),
                             **finish._evaluate(cfg, model, params, ds))  # noqa: SLF001 - the run's own numbers
                    f.write(json.dumps(e, separators=(",", ":")) + "\n")
                    f.flush()
            if stopped(POLL_S) or all((out / f"shard-{k}.pt").exists() for k in range(cfg.servers)):
                return  # told to, or the shards have stopped (training ended: the run evaluates the rest)


def _stdin_closed(seconds: float) -> bool:
    """Whether stdin reached EOF, waiting up to `seconds` for it."""
    ready, _, _ = select.select([sys.stdin], [], [], seconds)
    return bool(ready) and not sys.stdin.buffer.read1(1 << 12)


def main(argv: list[str]) -> int:
    from psgd.core.config import from_dict  # noqa: PLC0415

    out = Path(argv[0]) if argv else Path()
    try:
        why = unfit(from_dict(json.loads((out / "config.json").read_text())))
    except (OSError, ValueError) as e:
        why = f"{out}: not a psgd run folder ({e})"
    if why is not None:
        print(f"psgd live-eval: {why}", file=sys.stderr)
        return 2
    try:
        os.nice(10)  # below the run's processes: it takes what CPU they leave
    except OSError:
        pass
    try:
        follow(out, _stdin_closed)
    except KeyboardInterrupt:  # Ctrl-C reaches the run's whole process group: the run says it
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
