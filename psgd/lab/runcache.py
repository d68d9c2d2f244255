"""Which finished runs a suite may reuse instead of making them again.

Contract:
- A run lives in `RESULTS/runs/<digest>/` (psgd/lab/experiment.py `run_digest`: its config, `out`
  aside, and the training code's version). `is_cached(spec)`: that folder holds the run finished
  (summary.json), with the same config (config.json, compared through JSON) made by the same
  training code (provenance.json); a run on a `psgd cluster` (--hosts) only while the cluster of its
  name is up with the link it ran on (the config names the cluster, not its link).
- A reference profile's folder (results/reference/, results/transformer-reference/) sits beside
  its default profile's (`default_folder`, and its inverse `reference_summary`); a reference run
  whose config the default profile already ran (`twin`) is taken by hard links (`reuse_twin`)
  rather than made again: the reference profile's seeds begin with the default's (power.py).
- Reads files only (and `psgd cluster`'s state for a --hosts run); writes only where `reuse_twin`
  links a twin in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from psgd.core import config as C
from psgd.lab.experiment import RunSpec

__all__ = ["is_cached", "default_folder", "reference_summary", "twin", "reuse_twin"]


def is_cached(spec: RunSpec, same_link: bool = True) -> bool:
    """Whether spec's folder holds its finished run: the same config, made by the same training code
    and, for a run on a `psgd cluster` (--hosts), on the link of the cluster of that name up now
    (`same_link`; no such cluster: not reusable). The config names the cluster, not its link, and
    `psgd cluster up` may make the name again with another link. same_link=False: the run is
    finished, whatever link it had (re-analysing finished runs)."""
    out = Path(spec.cfg.out)
    try:
        recorded = json.loads((out / "config.json").read_text())
        made_by = json.loads((out / "provenance.json").read_text())
        # Compare through JSON: tuples in the dataclass are lists in the file.
        from psgd.train.launch import config_record  # noqa: PLC0415 - the config and the user's files' hashes

        # `out` aside: a reference run copied from the default profile's folder names where it was made.
        return ((out / "summary.json").exists()
                and _out_aside(recorded) == _out_aside(json.loads(json.dumps(config_record(spec.cfg))))
                and made_by.get("code_version") == spec.version
                and (not same_link or not spec.cfg.hosts or _on_the_same_link(spec.cfg, out)))
    except (OSError, ValueError):
        return False


def _out_aside(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "out"}


def _on_the_same_link(cfg: C.RunConfig, out: Path) -> bool:
    from psgd.cluster import netns
    from psgd.train import hosts

    c = netns.load(cfg.cluster)
    if c is None or not c.complete:
        return False
    now = hosts.link_record(c, cfg.mode)
    then = json.loads((out / "summary.json").read_text()).get("cluster") or {}
    return {k: then.get(k) for k in now} == now


def default_folder(results: Path) -> Path | None:
    """The default profile's folder beside a reference profile's (results/reference/ -> results/,
    results/transformer-reference/ -> results/transformer/): `reference_summary`'s inverse."""
    if results.name == "reference":
        return results.parent
    if results.name.endswith("-reference"):
        return results.parent / results.name.removesuffix("-reference")
    return None


def reference_summary(results: Path) -> dict | None:
    """The reference profile's summary.json beside a default profile's folder (results/ ->
    results/reference/, results/transformer/ -> results/transformer-reference/), or None."""
    folder = results / "reference" if results.name == "results" else results.parent / f"{results.name}-reference"
    path = folder / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def twin(spec: RunSpec) -> RunSpec | None:
    """The default profile's finished run of a reference run's config, where there is one: the same
    folder name (psgd/lab/experiment.py `run_digest`: the config, `out` aside, and the training code)
    under the default profile's runs/, made by the same training code. The reference profile's seeds
    begin with the default profile's (psgd/lab/power.py), and their tuning runs are the same runs."""
    out = Path(spec.cfg.out)
    home = default_folder(out.parent.parent)
    if home is None or out.exists():
        return None
    found = dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg, out=str(home / "runs" / out.name)))
    return found if is_cached(found) else None


def reuse_twin(spec: RunSpec) -> bool:
    """Take the default profile's finished run of this reference run's config (`twin`) into the
    reference's folder, by hard links (copies across file systems), rather than run it again; returns
    whether it did. Its files are as they were made: config.json's `out` names the folder it ran in."""
    found = twin(spec)
    if found is None:
        return False

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    shutil.copytree(found.cfg.out, spec.cfg.out, copy_function=link)
    return True
