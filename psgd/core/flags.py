"""The flag machinery of the config schema: one declaration per field, everything else derived.

- Each leaf field is declared once, with `opt(default, help, choices=..., metavar=...)`: its name,
  type, default and command-line help. From that one declaration come the flag
  (`batch_size` <-> `--batch-size`, in the help group its section names), the namespace -> config
  step (`from_namespace`), the flags that rebuild a config (`to_argv`), config.json
  (`to_dict` / `from_dict`) and the lab's TOML keys (psgd/lab/experiment.py reads `leaves()`).
- Types are the real annotations (`typing.get_type_hints`): bool (a bare store_true flag), int,
  float, str and `Pairs` (a repeatable `RANK=N` flag). A field's `parse` replaces the type's
  parser on the command line (`--servers` also takes HOST:PORT lists) and `from_arg` turns what it
  parsed into the field's value.
- Leaf names are unique across the nested sections (`data`, `model`, `optim`): flags and TOML
  keys are flat.

Every function here takes the schema it reads; psgd/core/config.py gives them `RunConfig` as the
default. Stdlib only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

Pairs = tuple[tuple[int, int], ...]   # (rank, n) pairs: a repeatable `--flag RANK=N`, a TOML list ["0=40"]


# -- the field declaration -----------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """What a config field needs besides its type and default to be a command-line flag."""
    help: str
    choices: Collection[str] = ()                       # a registry (a dict) stays live: later names count
    metavar: str | None = None
    aliases: tuple[str, ...] = ()                       # more option strings (`--num-shards`)
    parse: Callable[[str], Any] | None = None           # text -> value, ValueError if bad (default: the type)
    from_arg: Callable[[Any], Any] | None = None        # parsed value -> field value (default: as is)
    shown: str | None = None                            # the default as a user types it (`auto` for -1)


def opt(default: Any, help: str, *, choices: Collection[str] = (), metavar: str | None = None,
        aliases: tuple[str, ...] = (), parse: Callable[[str], Any] | None = None,
        from_arg: Callable[[Any], Any] | None = None, shown: str | None = None) -> Any:
    """A config field that is also a flag: `lr: float = opt(0.05, "learning rate")`. `shown`: the
    default in the help when the value stored is a sentinel the user does not type (`parse` must
    take `shown` to `default`)."""
    assert not isinstance(default, (list, dict, set)), "config defaults are immutable (frozen dataclasses)"
    assert shown is None or (parse is not None and parse(shown) == default), f"{shown!r} must parse to {default!r}"
    return field(default=default, metadata={"flag": Flag(help, choices, metavar, aliases, parse, from_arg, shown)})


def parse_pair(text: str) -> tuple[int, int]:
    """`RANK=N` -> (rank, n)."""
    try:
        a, b = text.split("=")
        return int(a), int(b)
    except ValueError:
        raise ValueError(f"expected RANK=NUMBER, got {text!r}") from None


def parse_servers(text: str) -> int | list[str]:
    """`--servers 2` (how many shards to start) or `--servers h1:p1,h2:p2` (shards to use)."""
    if text.lstrip("+-").isdigit():
        return int(text)   # a negative count is a count: `validate` says it must be >= 1
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT[,HOST:PORT...], got {a!r}")
    return addresses


def shard_count(servers: int | list[str]) -> int:
    """The config holds how many shards; `psgd worker` keeps the addresses from the namespace."""
    return servers if isinstance(servers, int) else len(servers)



def is_spec(name: str) -> bool:
    """A user's callable by import path (`pkg.mod:fn`, `path/file.py:fn`) rather than a built-in name."""
    left, sep, attr = name.rpartition(":")
    return bool(sep and left and attr)


# -- derived from the schema -------------------------------------------------------------------------
@dataclass(frozen=True)
class Leaf:
    """One flag-bearing field of a schema, with where it sits."""
    section: str          # "" for the schema's own fields, else the nested section's field name ("data")
    name: str             # the flag (--name-with-dashes), the TOML key, the namespace attribute
    type: Any             # the resolved annotation: bool, int, float, str or Pairs
    default: Any
    flag: Flag
    group: str            # help group title: the section class's GROUP, or its GROUPS title for the field


@functools.cache
def leaves(schema: type) -> tuple[Leaf, ...]:
    """The schema's flag-bearing fields in declaration order, the nested sections' fields in place."""
    out = []
    for f, typ in _fields(schema):
        if dataclasses.is_dataclass(typ):
            out += [Leaf(f.name, f2.name, t2, _default(f2), _flag(typ, f2), typ.GROUP) for f2, t2 in _fields(typ)]
        else:
            group = next((g for g, names in getattr(schema, "GROUPS", {}).items() if f.name in names), schema.GROUP)
            out.append(Leaf("", f.name, typ, _default(f), _flag(schema, f), group))
    names = [leaf.name for leaf in out]
    assert len(set(names)) == len(names), f"{schema.__name__}: field names repeat across sections: {names}"
    for leaf in out:
        assert leaf.type in (bool, int, float, str, Pairs), f"{leaf.name}: no flag for type {leaf.type}"
        assert leaf.type is not bool or leaf.default is False, f"{leaf.name}: a bool flag is off by default"
    return tuple(out)


@functools.cache  # a schema's fields never change; get_type_hints is most of a suite's loading (1,654 configs)
def _fields(klass: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    hints = typing.get_type_hints(klass)  # the real types, not the strings `from __future__` leaves
    return tuple((f, hints[f.name]) for f in dataclasses.fields(klass))


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _flag(klass: type, f: dataclasses.Field) -> Flag:
    flag = f.metadata.get("flag")
    assert isinstance(flag, Flag) and flag.help, f"{klass.__name__}.{f.name}: declare it with opt(default, help)"
    return flag


def add_flags(parser: argparse.ArgumentParser, schema: type, elsewhere: dict[str, str] | None = None) -> None:
    """Add one flag per leaf of the schema, in its section's help group.

    `elsewhere` maps the leaves this parser's process does not read to whose they are ("a worker's
    setting, not a shard's"): they stay out of -h, and one given anyway is a one-line usage error
    (exit 2) rather than a setting silently ignored."""
    groups: dict[str, Any] = {}
    for leaf in leaves(schema):
        if elsewhere and leaf.name in elsewhere:
            parser.add_argument("--" + leaf.name.replace("_", "-"), *leaf.flag.aliases, action=_Elsewhere,
                                owner=elsewhere[leaf.name], nargs=0 if leaf.type is bool else None)
            continue
        if leaf.group not in groups:
            groups[leaf.group] = parser.add_argument_group(leaf.group)
        flag = leaf.flag
        kw: dict[str, Any] = {"dest": leaf.name, "help": (flag.help + _default_note(leaf)).replace("%", "%%")}
        if flag.metavar:
            kw["metavar"] = flag.metavar
        if flag.choices:
            kw["choices"] = flag.choices
        parse = _for_argparse(flag.parse) if flag.parse else None
        if leaf.type is bool:
            kw["action"] = "store_true"
        elif leaf.type == Pairs:
            kw.update(type=parse or _for_argparse(parse_pair), action="append", default=list(leaf.default))
        else:
            kw.update(default=leaf.default)
            if parse or leaf.type is not str:
                kw["type"] = parse or leaf.type
        groups[leaf.group].add_argument("--" + leaf.name.replace("_", "-"), *flag.aliases, **kw)


class _Elsewhere(argparse.Action):
    """A flag of another process's room: refused where it is met, with whose it is."""

    def __init__(self, option_strings, dest, owner: str, nargs=None, **kw) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=nargs, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kw)
        self.owner = owner

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is {self.owner}")


def _default_note(leaf: Leaf) -> str:
    """' (default: X)' for the help, so that `-h` tells what a run does when the flag is left out.

    None for a bool (off unless given) and for an empty string or list: there is nothing to show,
    and the help says what leaving it out means. Derived here, not written into each help, so that
    the printed default cannot disagree with the real one.
    """
    if leaf.type is bool or leaf.default in ("", ()):
        return ""
    return f" (default: {leaf.flag.shown if leaf.flag.shown is not None else leaf.default})"


def _for_argparse(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse prints an ArgumentTypeError's message as is (a ValueError becomes 'invalid value')."""
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return wrapped


def from_namespace(ns: argparse.Namespace, schema: type) -> Any:
    """Parsed flags -> config (not validated: see `validate`); a leaf the parser did not take (another
    room's, see `add_flags`) keeps its default."""
    flat = {}
    for leaf in leaves(schema):
        if not hasattr(ns, leaf.name):
            continue
        value = getattr(ns, leaf.name)
        flat[leaf.name] = leaf.flag.from_arg(value) if leaf.flag.from_arg else value
    return from_flat(flat, schema)


def from_flat(flat: dict, schema: type) -> Any:
    """Flat leaf names (flags, TOML keys) -> config, the missing ones at their defaults (not validated)."""
    by_name = {leaf.name: leaf for leaf in leaves(schema)}
    unknown = [k for k in flat if k not in by_name]
    if unknown:
        raise ValueError(f"bad config: unknown key {unknown[0]!r}")
    values = {k: tuple(tuple(p) for p in v) if by_name[k].type == Pairs else v for k, v in flat.items()}
    nested: dict[str, dict] = {}
    for k, v in values.items():
        nested.setdefault(by_name[k].section, {})[k] = v
    top = nested.pop("", {})
    sections = {f.name: typ(**nested.get(f.name, {})) for f, typ in _fields(schema) if dataclasses.is_dataclass(typ)}
    return schema(**top, **sections)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict, schema: type) -> Any:
    """Inverse of to_dict (reads config.json): nested sections; unknown keys raise ValueError ("sources",
    the record of the user's files that config.json may hold, is skipped)."""
    where = {leaf.name: leaf.section for leaf in leaves(schema)}
    flat = {}
    for key, value in d.items():
        if key == "sources":  # config.json's record of the user's files (psgd/train/workload.py): not a setting
            continue
        section = key if key in where.values() and key and isinstance(value, dict) else ""
        for k, v in (value.items() if section else [(key, value)]):
            if where.get(k) != section:
                raise ValueError(f"bad config: unknown key {f'{section}.{k}' if section else k!r}")
            flat[k] = v
    try:
        return from_flat(flat, schema)
    except TypeError as e:
        raise ValueError(f"bad config: {e}") from None


def to_argv(cfg: Any, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The flags that rebuild cfg through `add_flags` (and so through `psgd run | server | worker`),
    less the leaves in `skip` (another room's: psgd/train/roles.py `flags_for`)."""
    argv: list[str] = []
    for leaf in leaves(type(cfg)):
        if leaf.name in skip:
            continue
        value = getattr(getattr(cfg, leaf.section) if leaf.section else cfg, leaf.name)
        flag = "--" + leaf.name.replace("_", "-")
        if leaf.type is bool:
            argv += [flag] if value else []
        elif leaf.type == Pairs:
            for rank, n in value:
                argv += [flag, f"{rank}={n}"]
        else:
            argv += [flag, str(value)]
    return argv
