"""Transport-agnostic pooling inference: model loading, tokenization, pooling, heads.

Nothing here imports grpc or protobuf; `service/` maps the wire format onto these types.
"""
