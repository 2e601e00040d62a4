"""The generated protobuf and gRPC modules of pooling.proto (scripts/gen_proto.py)."""
