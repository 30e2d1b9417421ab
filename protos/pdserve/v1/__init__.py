"""Generated stubs of the `pdserve.v1` proto package (do not edit the `*_pb2*` files; see pdserve.protos)."""
