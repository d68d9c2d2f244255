"""`-h` as one line per flag, `--help` in full: a process's settings on a screen or two.

`psgd server` and `psgd worker` take some 60 settings each; argparse's help gives every one its
whole sentence, which makes ~200 lines nobody reads. `add_short_help(parser)` makes `-h` print
each flag with the first clause of its help and its default, grouped as the full help is, and
leaves `--help` as argparse prints it. Stdlib only.
"""

from __future__ import annotations

import argparse
import re
import shutil

_DEFAULT = re.compile(r" \(default: (.*)\)$")
_CLAUSE = re.compile(r"(; |: |\. | \(| e\.g\.)")  # where a help's first clause ends
_QUALIFIER = re.compile(r"^([^:;(]{1,24}): ")  # "PS: ", "async / SSP: ", "with --topk < 1: " lead the clause


class OneLine(argparse.RawDescriptionHelpFormatter):
    """Each option on one line: its flags, the first clause of its help, its default."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help == argparse.SUPPRESS:
            return ""
        if isinstance(action, argparse._SubParsersAction):
            return super()._format_action(action)
        head = self._format_action_invocation(action)
        text = self._expand_help(action) if action.help else ""
        default = _DEFAULT.search(text)
        text = text[:default.start()] if default else text
        lead = _QUALIFIER.match(text)
        body = (lead.group(0) if lead else "") + _CLAUSE.split(text[lead.end() if lead else 0:], maxsplit=1)[0]
        if default:
            body += f" [{default.group(1)}]"
        width = max(shutil.get_terminal_size((100, 24)).columns, 80)
        line = f"  {head:<30} {body}" if len(head) <= 30 else f"  {head} {body}"
        return (line if len(line) <= width else line[:width - 3] + "...") + "\n"


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
