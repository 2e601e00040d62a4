"""Generated protobuf and gRPC modules for pooling.v1 (see scripts/gen_proto.py)."""
