"""Everything Ray: placement of pools, actor shells, the gRPC router, admin and scaling, and the `pdserve` CLI."""
