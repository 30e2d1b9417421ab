"""pdserve's gRPC API: the `.proto` files under `pdserve/v1/` (proto package `pdserve.v1`) and their generated
stubs, importable as `pdserve.v1` (`generation_pb2`, `admin_pb2`, and their `_pb2_grpc`). `python -m
pdserve.protos.generate` regenerates the stubs; tests/protos/test_stubs.py fails when they are stale.

The stubs were generated with grpcio-tools 1.85.1: they need grpcio >= 1.85.1 and protobuf >= 7.35.1, < 8 (the
protobuf gencode version they check at import).

| module | its one job |
|---|---|
| `generate` | regenerates the committed stubs |
"""

from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
"""The include root (`-I`): protos import as `pdserve/v1/<name>.proto`."""

PROTO_FILES = ("pdserve/v1/generation.proto", "pdserve/v1/admin.proto")

SERVICE_NAMES = ("pdserve.v1.Generation", "pdserve.v1.Admin")

__all__ = ["PROTO_FILES", "PROTO_ROOT", "SERVICE_NAMES"]
