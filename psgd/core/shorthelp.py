"""`-h` as one line per flag, `--help` in full: a process's settings on a screen or two.

`psgd run`, `psgd server` and `psgd worker` take some 60 settings each; argparse's help gives every
one its whole sentence, which makes 200-300 lines nobody reads. `add_short_help(parser)` makes `-h`
print each flag with the gist of its help and its default, grouped as the full help is, and leaves
`--help` as argparse prints it. The gist (`gist`) is the help's first clause with its asides left
out, whole words only: a line too long for the terminal ends in "..." before its default, so that
a cut is seen as one, never taken for the whole help. Stdlib only.
"""

from __future__ import annotations

import argparse
import re
import shutil

_DEFAULT = re.compile(r" \(default: (.*)\)$")
_END = re.compile(r"(; |(?<!\.)\. | e\.g\. )")  # where a help's first clause ends ("HOST:PORT,... of" goes on)
_TRAIL = " ,;:"                          # what a clause cut before " e.g." may end with


def gist(text: str) -> str:
    """A help's first clause, without its parenthesised asides: `async / SSP: DC-ASGD (Zheng et al.
    2017): the shard adds ...` -> `async / SSP: DC-ASGD: the shard adds ...`. An aside is a
    parenthesis after a word (`quorum (the sum ...)`); one after an operator is the formula's own
    (`m * MS + (1 - m) * g * g` keeps it)."""
    out, depth, i = [], 0, 0
    while i < len(text):
        c = text[i]
        if depth == 0 and c == "(" and i >= 2 and text[i - 1] == " " and (text[i - 2].isalnum() or text[i - 2] in ".)"):
            depth, i = 1, i + 1
            out.pop()  # the space before the aside
            continue
        if depth:
            depth += {"(": 1, ")": -1}.get(c, 0)
        else:
            out.append(c)
        i += 1
    return _END.split("".join(out), maxsplit=1)[0].rstrip(_TRAIL)


def fit(body: str, room: int) -> str:
    """`body` in `room` characters, cut after a whole word and marked "..." when it does not fit."""
    if len(body) <= room:
        return body
    cut = body[:max(0, room - 3)].rsplit(" ", 1)[0].rstrip(_TRAIL)
    return cut + "..."


class OneLine(argparse.RawDescriptionHelpFormatter):
    """Each option on one line: its flags, the gist of its help, its default."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help == argparse.SUPPRESS:
            return ""
        if isinstance(action, argparse._SubParsersAction):
            return super()._format_action(action)
        head = self._format_action_invocation(action)
        text = self._expand_help(action) if action.help else ""
        default = _DEFAULT.search(text)
        tail = f" [{default.group(1).split('; ')[0]}]" if default else ""  # `127.0.0.1; another needs...`: its value
        lead = f"  {head:<30} " if len(head) <= 30 else f"  {head} "
        width = max(shutil.get_terminal_size((100, 24)).columns, 80)
        body = fit(gist(text[:default.start()] if default else text), width - len(lead) - len(tail))
        return f"{lead}{body}{tail}".rstrip() + "\n"


class _ShortHelp(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        full = parser.formatter_class
        parser.formatter_class = OneLine
        try:
            parser.print_help()
        finally:
            parser.formatter_class = full
        parser.exit()


def add_short_help(parser: argparse.ArgumentParser) -> None:
    """Give a parser made with add_help=False `-h` (one line a flag) and `--help` (in full)."""
    parser.add_argument("-h", action=_ShortHelp, help="show one line per flag and exit (--help: in full)")
    parser.add_argument("--help", action="help", help="show every flag's whole help and exit")
