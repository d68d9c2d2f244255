"""The committed generated code must match what `make proto` produces from the .proto."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for path in gen.generate(tmp_path):
        committed = ROOT / "psgd" / "_proto" / path.name
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make proto`"
