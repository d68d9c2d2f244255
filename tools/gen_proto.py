"""Regenerate the gRPC Python code from protos/ into psgd/_proto/ (or another folder).

`make proto` runs this; tests/test_proto.py runs it into a temporary folder and fails when
the committed code differs, so the committed code can never drift from the .proto.

    python tools/gen_proto.py [OUT_DIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = "psgd/v1/parameter_server.proto"


def generate(out_dir: Path) -> list[Path]:
    """Write parameter_server_pb2.py and _pb2_grpc.py into out_dir; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"-I{include}",
                          f"--python_out={tmp}", f"--grpc_python_out={tmp}", PROTO])
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        written = []
        for name in ("parameter_server_pb2.py", "parameter_server_pb2_grpc.py"):
            text = (Path(tmp) / "psgd" / "v1" / name).read_text()
            # protoc derives the import from the proto's path; our package lives at psgd._proto.
            text = text.replace("from psgd.v1 import", "from psgd._proto import")
            (out_dir / name).write_text(text)
            written.append(out_dir / name)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "psgd" / "_proto"
    for path in generate(target):
        print(f"wrote {path}")
