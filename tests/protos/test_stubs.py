"""The committed gRPC stubs are what grpc_tools.protoc makes from the committed .proto files today."""

from __future__ import annotations

import pytest

from pdserve.protos import PROTO_ROOT
from pdserve.protos.generate import generate


def test_committed_stubs_are_fresh(tmp_path):
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in generate(tmp_path)}
    assert fresh, "protoc produced nothing"
    for relative, content in fresh.items():
        committed = PROTO_ROOT / relative
        assert committed.is_file(), f"{committed} missing: run `python -m pdserve.protos.generate`"
        assert committed.read_bytes() == content, (
            f"{committed} is stale: run `python -m pdserve.protos.generate`"
        )
    stubs = {p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*_pb2*.py*")}
    assert stubs == set(fresh), "stubs without a .proto: delete them"


@pytest.mark.parametrize("module", ["generation_pb2_grpc", "admin_pb2_grpc"])
def test_stubs_import_as_pdserve_v1(module):
    imported = __import__(f"pdserve.v1.{module}", fromlist=[module])
    assert imported.__name__ == f"pdserve.v1.{module}"
