"""Rank 0's pooling: a step's pooling sequences' hidden states into one vector each, as the checkpoint says
(common/pooling.py): cls, mean, max or last token, then Normalize; or, for a cross-encoder, the
classification head over [CLS] and its activation. Every pooling sequence's whole prompt is in the step
(the scheduler never chunks one), so its rows are all there.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from common.pooling import PoolingConfig


class Pooler:
    def __init__(self, config: PoolingConfig, model: torch.nn.Module):
        self.config = config
        self.model = model
        if config.cross_encoder and not hasattr(model, "classify"):
            raise ValueError(f"{type(model).__name__} has no classification head to score pairs with")

    @property
    def size(self) -> int:
        """The length of each vector."""
        mc = self.model.config
        return getattr(mc, "num_labels", 1) if self.config.cross_encoder else mc.hidden_size

    def pool(self, hidden: torch.Tensor, query_lens: np.ndarray, index: np.ndarray) -> list[float]:
        """The vectors of sequences `index` (batch positions) of a step whose rows are hidden [T, hidden],
        concatenated (each self.size floats)."""
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        method = "cls" if self.config.cross_encoder else self.config.method
        if method in ("cls", "last"):
            rows = starts[index] if method == "cls" else ends[index] - 1
            vectors = hidden.index_select(0, torch.from_numpy(rows).to(hidden.device))
        else:  # one reduction over the step's rows, by sequence (not a loop of small ones)
            seq = torch.from_numpy(np.repeat(np.arange(len(query_lens)), query_lens)).to(hidden.device)
            rows = hidden.float()
            if method == "mean":
                sums = rows.new_zeros(len(query_lens), rows.shape[1]).index_add_(0, seq, rows)
                vectors = sums / torch.from_numpy(np.asarray(query_lens)).to(sums)[:, None]
            else:
                seq = seq[:, None].expand_as(rows)
                vectors = rows.new_empty(len(query_lens), rows.shape[1])
                vectors = vectors.scatter_reduce_(0, seq, rows, "amax", include_self=False)
            vectors = vectors.index_select(0, torch.from_numpy(np.asarray(index)).to(hidden.device))
        if self.config.cross_encoder:
            vectors = self.model.classify(vectors.to(hidden.dtype)).float()
            if self.config.activation == "sigmoid":
                vectors = torch.sigmoid(vectors)
        vectors = vectors.float()
        if self.config.normalize:
            vectors = F.normalize(vectors, p=2.0, dim=-1)
        return vectors.reshape(-1).cpu().tolist()


def token_types(query_lens: np.ndarray, index: np.ndarray, type_starts: list[int]) -> np.ndarray | None:
    """[T] token type ids: 1 from type_starts[k] on in pooling sequence index[k] (a cross-encoder's second
    text), 0 elsewhere; None when no sequence has a second text."""
    if not any(type_starts):
        return None
    ends = np.cumsum(query_lens)
    types = np.zeros(int(ends[-1]), dtype=np.int64)
    for i, start in zip(index.tolist(), type_starts, strict=True):
        if start:
            types[ends[i] - query_lens[i] + start : ends[i]] = 1
    return types
