"""`psgd bench startup`: a run's start-up, forked from the warm parent against exec'd, beside one import.

For each shape K shards + N workers (default 1+1, 2+4, 4+8) it runs the same short sync job
(`psgd run --mode sync --model mlp --dataset mnist1d --steps 20`, data cached first) warm (the
default: every child forked from psgd/train/zygote.py) and `--cold-start` (every child exec'd),
interleaved round by round, and in the same rounds times `python -c "import torch, grpc, numpy"`:
the ceiling a start-up could reach if it paid one import. Reported per shape: the median of
summary.json's `startup_s` (from the launcher's start to the start barrier's release) both ways,
their ratio, and each against the import time. A machine shared with other work moves every
figure; the ratios measured side by side are the finding.

    psgd bench startup --rounds 3 --out results/bench/startup
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPORT = [sys.executable, "-c", "import torch, grpc, numpy"]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    from psgd.core.errors import UsageError

    shapes = []
    for part in text.split(","):
        k, _, n = part.strip().partition("+")
        if not (k.isdigit() and n.isdigit() and int(k) >= 1 and int(n) >= 1):
            raise UsageError(f"--shapes takes K+N,... (shards + workers, each >= 1), got {part!r}")
        shapes.append((int(k), int(n)))
    return shapes


def one_run(k: int, n: int, cold: bool, out: Path, dataset: str = "mnist1d") -> float:
    argv = [sys.executable, "-m", "psgd", "run", "--mode", "sync", "--workers", str(n), "--servers", str(k),
            "--model", "mlp", "--dataset", dataset, "--steps", "20", "--eval-every", "0", "--quiet",
            "--out", str(out), *(["--cold-start"] if cold else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads((out / "summary.json").read_text())["startup_s"]


def import_time() -> float:
    t0 = time.perf_counter()
    subprocess.run(IMPORT, check=True, timeout=300)
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd bench startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1+1,2+4,4+8", help="K+N shapes (shards + workers), comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every shape warm and cold (median)")
    p.add_argument("--out", default="", help="write startup.json and STARTUP.md into this folder")
    p.add_argument("--dataset", default="mnist1d", choices=("mnist1d", "synthetic"),
                   help="the runs' data (mnist1d: README's first command; its cache is filled before the timings)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {a.rounds}")
    shapes = parse_shapes(a.shapes)
    if a.dataset == "mnist1d":
        with tempfile.TemporaryDirectory(prefix="psgd-bench-cache-") as cache_run:
            subprocess.run([sys.executable, "-m", "psgd", "run", "--dataset", "mnist1d", "--steps", "1", "--workers",
                            "1", "--quiet", "--out", cache_run], check=True, timeout=600,
                           capture_output=True)  # the mnist1d cache, outside the timings
    raw: dict[str, list[float]] = {"import": []}
    with tempfile.TemporaryDirectory(prefix="psgd-bench-startup-") as tmp:
        for r in range(a.rounds):
            raw["import"].append(import_time())
            for k, n in shapes:
                for cold in (False, True):
                    key = f"{k}+{n} {'cold' if cold else 'warm'}"
                    folder = Path(tmp) / f"{key.replace(' ', '-')}-{r}"
                    raw.setdefault(key, []).append(one_run(k, n, cold, folder, a.dataset))
    med = {key: statistics.median(v) for key, v in raw.items()}
    rows = [{"shards": k, "workers": n, "processes": k + n, "warm_s": med[f"{k}+{n} warm"],
             "cold_s": med[f"{k}+{n} cold"], "cold_over_warm": med[f"{k}+{n} cold"] / med[f"{k}+{n} warm"],
             "warm_over_import": med[f"{k}+{n} warm"] / med["import"],
             "cold_over_import": med[f"{k}+{n} cold"] / med["import"]} for k, n in shapes]
    result = {"command": "psgd bench startup " + " ".join(argv), "import_s": med["import"], "rows": rows, "raw": raw}
    lines = [f"# psgd bench startup\n\nCommand: `{result['command']}`\n",
             f"`python -c \"import torch, grpc, numpy\"`: {med['import']:.2f} s (median of {a.rounds})\n",
             "| K+N | warm startup_s | cold startup_s | cold / warm | warm / import | cold / import |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['shards']}+{r['workers']} | {r['warm_s']:.2f} | {r['cold_s']:.2f} | {r['cold_over_warm']:.2f}x | "
              f"{r['warm_over_import']:.2f}x | {r['cold_over_import']:.2f}x |" for r in rows]
    table = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "startup.json").write_text(json.dumps(result, indent=1))
        (Path(a.out) / "STARTUP.md").write_text(table)
    print(table)
    return 0
