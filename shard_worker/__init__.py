"""One tensor-parallel slice of the model on one device: its KV tensors and the forward pass."""
