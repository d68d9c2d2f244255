"""The live line of a run follows the workers' step events in OUT/metrics.jsonl."""

import json
import threading

from psgd.train import progress


class Bar:
    def __init__(self):
        self.n, self.postfix = 0, {}

    def update(self, n):
        self.n += n

    def set_postfix(self, refresh=False, **kw):
        self.postfix = kw


def test_follow_counts_complete_step_lines_and_the_largest_clock_gap(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"event": "step", "rank": r, "clock": c, "clock_gap": g}, separators=(",", ":"))
             for r, c, g in [(0, 0, 0), (1, 0, 0), (0, 1, 3), (1, 1, 1)]]
    lines.append(json.dumps({"event": "worker_end", "rank": 0}, separators=(",", ":")))
    path.write_text("\n".join(lines) + "\n" + '{"event":"step","clock_gap":9')  # a line still being written
    stop, bar = threading.Event(), Bar()
    stop.set()  # one pass: the last read after the run ended
    progress._follow(path, bar, stop)
    assert bar.n == 4 and bar.postfix == {"max_clock_gap": 3}


def test_a_missing_file_is_not_an_error(tmp_path):
    stop, bar = threading.Event(), Bar()
    stop.set()
    progress._follow(tmp_path / "metrics.jsonl", bar, stop)
    assert bar.n == 0
