"""Loaded by every psgd process of tests/test_rooms.py (PYTHONPATH): records each setting a process
reads from its RunConfig, outside the schema's own code (validation, flags, serialisation), one
`ROLE NAME` line per first read into $PSGD_TRACE_READS/PID.txt.

The run's zygote loads this once and its forks inherit it: a fork's role is read from its own argv
(the zygote sets it) at its first read, and what it has seen starts empty in each process."""

import dataclasses
import os
import sys

_DIR = os.environ.get("PSGD_TRACE_READS")
# The schema's own reads (every check of `validate` and `__post_init__` reads every field it
# checks, the flag and dict round trips read them all): not what a room's code uses.
_SCHEMA_OWN = ("validate", "__post_init__", "__eq__", "__hash__", "__repr__")


def _install() -> None:
    from psgd.core import schema, sections

    mine: dict[str, object] = {"pid": None}  # this process's role and the names it has recorded

    def seen() -> set[str]:
        if mine["pid"] != os.getpid():   # the first read in this process (a fork starts afresh)
            role = next((a for a in sys.argv[1:] if a in ("server", "worker", "run")), "other")
            mine.update(pid=os.getpid(), role=role, seen=set())
        return mine["seen"]

    def traced(cls: type, prefix: str) -> None:
        names = {f.name for f in dataclasses.fields(cls)}
        plain = object.__getattribute__

        def __getattribute__(self, name):
            if name in names and prefix + name not in seen():
                code = sys._getframe(1).f_code
                ours = code.co_filename.endswith(("psgd/core/flags.py", "dataclasses.py", "copy.py"))
                checks = code.co_name.startswith(("_check", "check_")) or code.co_name in _SCHEMA_OWN
                if not ours and not checks:
                    seen().add(prefix + name)
                    with open(os.path.join(_DIR, f"{os.getpid()}.txt"), "a") as f:
                        f.write(f"{mine['role']} {name}\n")
            return plain(self, name)

        cls.__getattribute__ = __getattribute__

    traced(schema.RunConfig, "")
    for cls in (sections.DataConfig, sections.ModelConfig, sections.OptimConfig):
        traced(cls, cls.__name__ + ".")


if _DIR:
    _install()
