"""The errors every layer shares, below everything that raises or catches them.

- `UsageError`: bad input at the edge (a flag, a config file, an environment variable); the CLI
  prints its one line and exits 2. `Parser` is argparse with the same one-line errors, no
  abbreviated flags (`--step 50` is refused, not taken as `--steps`), and an unknown flag named
  with the closest real one.
- `ShardError(code, message)`: a request a parameter shard refused, nothing changed. `code` is a
  `Code`, named as gRPC's status codes so that the gRPC adapter passes it on by name and the TCP
  data plane writes the same name in its ERROR frame; the shard itself knows no transport.
- `ExchangeError`: a worker's push / pull / init failed; one line naming the shard and the status,
  and the status's name as `code` where one came back.
"""

from __future__ import annotations

import argparse
import difflib
import enum


class UsageError(ValueError):
    """Bad input at the edge: one line that says what to change (exit code 2)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `psgd run: error: ... (see psgd run -h)`, exit 2.

    Abbreviations are off (every subparser is a Parser too): a prefix that means one flag today
    means another, or none, once a flag is added, and a typo taken silently for a real flag
    (`--step 50` as `--steps`) runs something else than asked."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # argparse's subcommand parser hands the flags it does not know up to the top parser, whose
        # error would then point at `psgd -h`: refuse them where they were met (`psgd run -h`).
        # Every Parser refuses unknown arguments anyway (parse_args), so nothing else changes.
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self._unrecognized(extras))
        return namespace, extras

    def _unrecognized(self, extras: list[str]) -> str:
        """The first unknown flag and the closest real one (`--wokers`: did you mean --workers?)."""
        flags = [a for a in extras if a.startswith("-") and len(a) > 1]
        if not flags:
            return f"unrecognized arguments: {' '.join(extras)}"
        flag = flags[0].split("=", 1)[0]
        known = [s for s in self._option_string_actions if s.startswith("--")]
        close = difflib.get_close_matches(flag, known, n=1)
        if close:  # the suggestion replaces the pointer to -h: it is the one line to read
            self.exit(2, f"{self.prog}: error: unrecognized argument {flag} (did you mean {close[0]}?)\n")
        return f"unrecognized argument {flag}"


class Code(enum.Enum):
    """Why a shard refused a request (the gRPC status code of the same name)."""
    INVALID_ARGUMENT = "INVALID_ARGUMENT"        # malformed or out-of-protocol request
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # the shard is not ready for it (not initialised)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"      # a held pull ran past its deadline


class ShardError(Exception):
    """A request refused by the shard: a `Code` and a one-line message (no state changed)."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class ExchangeError(RuntimeError):
    """A push, pull or init failed; the message names the shard and the status. `code`: the
    status's name where one came back (a `Code`'s, or gRPC's: "UNAVAILABLE"), else ""."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code
