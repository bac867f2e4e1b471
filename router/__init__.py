"""The public gRPC entry point: tokenizes, validates, streams text back."""
