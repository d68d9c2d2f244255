"""The package's import graph, read from the source: no cycles, and arrows point down only.

Layers, bottom to top (docs/architecture.md draws them and lists every arrow between them, a list
the last tests here hold to the code's):

    _proto, core        the wire messages; pure cores: policies, sharding, codec, link, optimizer,
                        cost model, config schema, errors, the step types, the palette
    ps | allreduce      the parameter-server plumbing | the all-reduce mode | network namespaces
      | cluster         with kernel-shaped links (psgd cluster); never each other
    train               the worker loop, data, models, metrics, evaluation, the launcher
    bench               benchmarks and the cost model's command line
    lab                 suite, experiments, analyses, verdicts, plots, report
    api                 the public Python API (psgd.fit, start_shards, connect), re-exported by psgd/__init__
    cli                 the face: parses, then calls down; nothing imports it but __main__

Every import counts, also one inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "psgd"
LAYER = {"_proto": 0, "core": 1, "ps": 2, "allreduce": 2, "cluster": 2, "train": 3, "bench": 4, "lab": 5, "api": 6,
         "cli": 7, "__main__": 8,
         "sim": 3.5}  # the simulated cluster drives train's pieces; bench, api and cli drive it
# What the pure cores may not touch: transports, processes, plotting.
NOT_IN_CORE = ("grpc", "socket", "socketserver", "subprocess", "matplotlib", "psgd._proto")


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path, names: set[str]) -> set[str]:
    """Every module `path` imports (psgd modules resolved to the most specific known name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in names)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    names = set(mods)
    return {name: {d for d in imports(path, names) if d in names and d != name and not name.startswith(d + ".")}
            for name, path in mods.items()}


def layer(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    return (parts[1], LAYER[parts[1]]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    assert [m for m in modules() if m != "psgd" and m.split(".")[1] not in LAYER] == []


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert cycles == []


def test_imports_point_down_only():
    wrong = []
    for m, deps in graph().items():
        here = layer(m)
        for d in deps:
            there = layer(d)
            if here is None or there is None or here[0] == there[0]:
                continue
            if there[1] >= here[1]:  # same layer, other package (ps vs allreduce), or above
                wrong.append(f"{m} -> {d}")
    assert sorted(wrong) == []


@pytest.mark.parametrize("module", sorted(m for m in modules() if m.startswith("psgd.core")))
def test_pure_cores_touch_no_transport(module):
    found = imports(modules()[module], set())
    assert sorted(i for i in found if i.split(".")[0] in NOT_IN_CORE or i.startswith(NOT_IN_CORE)) == []


def test_the_walk_sees_lazy_imports_and_would_catch_a_cycle(tmp_path):
    # The checker itself: an import inside a function counts.
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from psgd.lab import report\n")
    assert "psgd.lab.report" in imports(f, {"psgd.lab.report"})


def test_commands_the_cli_imports_by_name_point_down_too():
    # `psgd suite | plot | bench | model` are imported with importlib from a table: a dependency
    # the ast walk cannot see, checked here.
    from psgd import cli

    here = LAYER["cli"]
    assert all(layer(target)[1] < here for target in cli.MODULES.values())
    assert all(target in modules() for target in cli.MODULES.values())


def drawn_arrows() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """docs/architecture.md's list of every arrow between layers: (imported, by name)."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    block = doc.split("Every arrow between layers", 1)[1].split("```", 2)[1]
    imported, by_name = set(), set()
    for line in block.strip().splitlines():
        source, _, rest = line.partition("->")
        targets, _, named = rest.partition("(by name:")
        imported |= {(source.strip(), t.strip()) for t in targets.split(",")}
        by_name |= {(source.strip(), t.strip(" )")) for t in named.split(",") if t.strip(" )")}
    return imported, by_name


def test_the_drawing_in_architecture_md_is_the_codes_arrows():
    from psgd import cli

    code = {(layer(m)[0], layer(d)[0]) for m, deps in graph().items() for d in deps
            if layer(m) and layer(d) and layer(m)[0] != layer(d)[0]}
    imported, by_name = drawn_arrows()
    assert imported == code, f"drawn, not in the code: {imported - code}; in the code, not drawn: {code - imported}"
    assert by_name == {("cli", layer(t)[0]) for t in cli.MODULES.values()}


def test_the_cli_starts_no_thread_before_a_shard_blocks_its_stop_signals():
    """`psgd server` blocks SIGTERM and SIGINT first thing in cmd_server, and every thread started
    later inherits the mask; a thread started before it (numpy's BLAS pool, which `import numpy`
    starts) would take the launcher's SIGTERM while the shard writes its files and kill it unsaved
    (a cold or --hosts run then failed, 'shard 0/1 exited with code -15'). Importing psgd's CLI, and
    the shard's room, starts none."""
    code = ("import os, sys\n"
            "import psgd.cli, psgd.train.serve\n"
            "threads = os.listdir(f'/proc/{os.getpid()}/task')\n"
            "assert len(threads) == 1, f'{len(threads)} threads; numpy loaded: {\"numpy\" in sys.modules}'\n")
    # As a launcher's child gets it: the tests' OMP_NUM_THREADS=1 would keep numpy's pool at no thread.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_launcher_leaves_torch_to_its_children_and_optim_leaves_dynamo_out():
    """Start-up costs: `psgd run` imports no torch until training is over (its children import it
    meanwhile on the same cores), and psgd's SGD never imports torch._dynamo (~0.9 s of CPU that
    constructing a torch.optim.Optimizer costs)."""
    code = ("import sys\n"
            "import psgd.cli, psgd.train.launch, psgd.train.progress, psgd.train.hosts\n"
            "assert 'torch' not in sys.modules, 'the launcher imported torch'\n"
            "import torch\n"
            "from psgd.core.config import OptimConfig\n"
            "from psgd.core.optim import SGD\n"
            "p = torch.zeros(3); p.grad = torch.ones(3)\n"
            "SGD(p, OptimConfig(momentum=0.9), fused=True).step()\n"
            "assert 'torch._dynamo' not in sys.modules, 'optim imported torch._dynamo'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
