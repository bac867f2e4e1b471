"""Triton kernels of the CUDA attention backend: paged_attention() over the paged KV cache.

triton_paged_attention.py holds the kernels (and explains their tiling and grid); host.py launches
them, checks their arguments and plans their tiles and KV splits, from host metadata only. Importing
this package imports triton; under TRITON_INTERPRET=1 (set before the import) the kernels run on CPU
tensors.
"""

from shard_worker.attention.kernels.host import (
    INTERPRET,
    MAX_HEAD_DIM,
    MAX_KV_SPLITS,
    MAX_QUERIES_PER_KV,
    SUPPORTED_DTYPES,
    TilePlan,
    kv_split_workspace_numel,
    paged_attention,
    plan_kv_splits,
    plan_tiles,
)

__all__ = [
    "INTERPRET",
    "MAX_HEAD_DIM",
    "MAX_KV_SPLITS",
    "MAX_QUERIES_PER_KV",
    "SUPPORTED_DTYPES",
    "TilePlan",
    "kv_split_workspace_numel",
    "paged_attention",
    "plan_kv_splits",
    "plan_tiles",
]
