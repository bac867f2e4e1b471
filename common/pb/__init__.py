"""Protobuf and gRPC stubs, generated from protos/ by `make proto` into common/pb/tpserve (not committed)."""
