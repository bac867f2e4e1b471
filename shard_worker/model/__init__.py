"""The model a shard worker runs: config, tensor-parallel layers, paged attention, decoder, loader."""
