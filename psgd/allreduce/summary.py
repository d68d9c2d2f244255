"""`summary_extra`: an all-reduce run's summary.json fields, from what its ranks left in the run folder.

`CollectiveExchange.close` (psgd/allreduce/collective.py, which re-exports this) has every rank
write OUT/replica-R.json (traffic, times, checks, final hash); `psgd run` (psgd/train/launch.py)
folds them into summary.json here, after the workers have exited.
"""

from __future__ import annotations

import json
from pathlib import Path


def summary_extra(out: Path, final_sha256: str) -> dict:
    """summary.json fields of an all-reduce run, from the replica-R.json files in `out`.

    `replicas_consistent`: every rank's last check agreed, and on that hash, which is the one
    of the parameters rank 0 saved. `bytes_sent`: per worker (estimated for the library).
    """
    reports = sorted((json.loads(p.read_text()) for p in out.glob("replica-*.json")), key=lambda r: r["rank"])
    if not reports:
        raise FileNotFoundError(f"no replica-R.json in {out}: did the all-reduce workers finish?")
    first = reports[0]
    return {
        "allreduce_impl": first["allreduce_impl"], "backend": first["backend"], "bucket_mb": first["bucket_mb"],
        "replicas_consistent": all(r["replicas_consistent"] and r["final_sha256"] == final_sha256 for r in reports),
        "consistency_checks": first["checks"],
        "bytes_sent": {str(r["rank"]): r["bytes_sent"] for r in reports},
        "bytes_sent_estimated": first["bytes_estimated"],
        "allreduce_s": sum(r["allreduce_s"] for r in reports) / len(reports),
        "optimizer_s": sum(r["optimizer_s"] for r in reports) / len(reports),
    }
