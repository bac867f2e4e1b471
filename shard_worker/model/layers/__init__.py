"""Layers every model family shares: linear and embedding (tensor-parallel), norms, rotary, MLP, MoE."""
