"""Pieces shared by the router, the scheduler and the shard workers."""
