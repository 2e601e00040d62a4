"""The gRPC door: PoolingService's servicer and its registration (handlers), protobuf
conversion, read turns for large messages, and the Node.js door over @grpc/grpc-js."""
