"""Run settings as the lab's TOML files write them: flat keys <-> the nested RunConfig.

Contract:
- A setting is a RunConfig leaf field's name (psgd/core/config.py `leaves()`: `workers`, `lr`,
  `straggler = ["0=40"]`, ...) with that field's type; `known_keys()` maps each to (section, type).
- `config_from_settings(settings, where)` builds and validates a RunConfig; `check_table(table,
  where, skip)` checks a [base] or [profiles.X] table on its own, before it is merged anywhere.
- Every refusal is a `SuiteError` (a bad suite or experiment file) whose one line names the file
  (`where`) and the key. Pure: no I/O, no process.
"""

from __future__ import annotations

import re

from psgd.core import config as C

__all__ = ["SuiteError", "SIM_KEYS", "RUN_KEYS", "PROFILE_KEYS", "known_keys", "coerce", "check_table",
           "sim_settings", "config_from_settings"]

# A simulated arm (`simulate = true`, psgd/sim/): its time model's settings, `psgd run --simulate`'s flags.
SIM_KEYS = {"simulate", "sim_compute", "sim_speeds", "sim_spread", "sim_apply", "sim_profile"}
RUN_KEYS = {"label", "lr_from", "lr_factor", "tune_lr", "tune", "eval_samples"} | SIM_KEYS  # besides RunConfig fields


class SuiteError(ValueError):
    """A bad suite or experiment file; the message names the file and the key."""


def known_keys() -> dict[str, tuple[str, object]]:
    """Flat key -> (section, type): RunConfig's leaf fields, "" for its own, else "data" | "model" | "optim"."""
    return {leaf.name: (leaf.section, leaf.type) for leaf in C.leaves()}


def coerce(key: str, typ: object, value, where: str):
    def bad(expected: str) -> SuiteError:
        return SuiteError(f"{where}: key {key!r} must be {expected}, got {value!r}")

    if typ is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if typ == C.Pairs:
        if not isinstance(value, list):
            raise bad('a list like ["0=40"]')
        pairs = []
        for item in value:
            m = re.fullmatch(r"\s*(\d+)\s*=\s*(\d+)\s*", item) if isinstance(item, str) else None
            if not m:
                raise bad('a list like ["0=40"]')
            pairs.append((int(m[1]), int(m[2])))
        return tuple(pairs)
    raise bad(f"a value of type {typ}")


PROFILE_KEYS = {"seeds", "bench_args", "tune", "params", "runs"}  # a profile's own keys, besides settings


def check_table(table: object, where: str, skip: frozenset[str] | set[str] = frozenset()) -> dict:
    """A [base] or [profiles.X] table, checked on its own before it is merged anywhere: every key is
    a run setting (or a run key such as eval_samples) and every value has the setting's type, so a
    typo is reported in the table that has it, and also when another profile would override it."""
    if not isinstance(table, dict):
        raise SuiteError(f"{where}: must be a table")
    keys = known_keys()
    for key, value in table.items():
        if key in RUN_KEYS - {"label"} or key in skip:
            continue  # checked where they are used (a run's keys, a profile's seeds / tune / runs ...)
        if key not in keys:
            raise SuiteError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(keys))})")
        coerce(key, keys[key][1], value, where)
    return table


def sim_settings(meta: dict, where: str) -> dict:
    """A run's simulation settings (SIM_KEYS popped from its table): {} for a real run, else
    psgd/sim/run.py `SimConfig`'s fields (compute, speeds, spread, apply, profile) as strings."""
    sim = {k: v for k, v in meta.items() if k in SIM_KEYS}
    if not sim:
        return {}
    on = sim.pop("simulate", False)
    if not isinstance(on, bool):
        raise SuiteError(f"{where}: key 'simulate' must be true or false, got {on!r}")
    if not on:
        if sim:
            raise SuiteError(f"{where}: keys {', '.join(sorted(sim))} set a simulated run's time model: "
                             "add simulate = true")
        return {}
    for k, v in sim.items():
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise SuiteError(f"{where}: key {k!r} must be a string like \"5ms\", got {v!r}")
    return {k.removeprefix("sim_"): str(v) for k, v in sorted(sim.items())}


def config_from_settings(settings: dict, where: str) -> C.RunConfig:
    """Build and validate a RunConfig from flat settings; SuiteError names the bad key."""
    keys = known_keys()
    flat = {}
    for key, value in settings.items():
        if key not in keys:
            raise SuiteError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(keys))})")
        flat[key] = coerce(key, keys[key][1], value, where)
    try:
        return C.validate(C.from_flat(flat))
    except ValueError as e:
        raise SuiteError(f"{where}: {e}") from None
