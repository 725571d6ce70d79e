"""Generated protobuf and gRPC code for package pdgrpc.v1. Do not edit: run `make gen`."""
