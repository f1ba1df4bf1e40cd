"""Generated gRPC/protobuf code for the capctl.v1 protocol (from protos/ by `make build`)."""
