"""Regenerates the committed stubs (`python -m pdserve.protos.generate [OUT_DIR]`): message classes, type stubs
and gRPC service classes for every file in PROTO_FILES, compiled with `-I protos` so that generated code imports
`pdserve.v1.*`. Without OUT_DIR it writes next to the .proto files."""

from __future__ import annotations

import sys
from pathlib import Path

from pdserve.protos import PROTO_FILES, PROTO_ROOT


def generate(out_dir: Path, proto_files: tuple[str, ...] = PROTO_FILES) -> list[Path]:
    """Compiles the protos into `out_dir` (mirroring `pdserve/v1/`); returns the files written."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    argv = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *proto_files,
    ]
    if protoc.main(argv) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(argv)}")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*") if p.is_file())


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    for path in generate(out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
