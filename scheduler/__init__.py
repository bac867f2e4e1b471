"""The single source of truth: sequences, the paged KV block table, the batch of every iteration."""
