"""Rank 0's pooling: a step's pooling sequences' hidden states into one vector each, as the checkpoint says
(common/pooling.py): cls, mean, max or last token, then any Dense modules, then Normalize; or, for a
cross-encoder, the classification head over [CLS] (a decoder's: over the last token) and its activation.
Every pooling sequence's whole prompt is in the step (the scheduler never chunks one), so its rows are all
there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.pooling import PoolingConfig

_ACTIVATIONS = {
    "tanh": torch.tanh,
    "identity": lambda x: x,
    "relu": F.relu,
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,
}


class Pooler:
    def __init__(self, config: PoolingConfig, model: torch.nn.Module, model_dir: str | Path):
        self.config = config
        self.model = model
        if config.cross_encoder and not hasattr(model, "classify"):
            raise ValueError(f"{type(model).__name__} has no classification head to score pairs with")
        width = model.config.hidden_size
        self.dense = []  # (weight, bias or None, activation) of each Dense module, in float32
        for module in config.dense:
            if module.in_features != width:
                raise ValueError(f"{module.path}: in_features {module.in_features}, the vectors have {width}")
            weight, bias = _dense_weights(Path(model_dir) / module.path, module)
            self.dense.append((weight, bias, _ACTIVATIONS[module.activation]))
            width = module.out_features

    @property
    def size(self) -> int:
        """The length of each vector."""
        mc = self.model.config
        if self.config.cross_encoder:
            return getattr(mc, "num_labels", 1)
        return self.config.dense[-1].out_features if self.config.dense else mc.hidden_size

    def pool(self, hidden: torch.Tensor, query_lens: np.ndarray, index: np.ndarray) -> list[float]:
        """The vectors of sequences `index` (batch positions) of a step whose rows are hidden [T, hidden],
        concatenated (each self.size floats)."""
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        method = self.config.method  # a cross-encoder's: the row its head reads (cls, or last)
        if method in ("cls", "last"):
            rows = starts[index] if method == "cls" else ends[index] - 1
            vectors = hidden.index_select(0, torch.from_numpy(rows).to(hidden.device))
        else:  # one reduction over the step's rows, by sequence (not a loop of small ones)
            seq = torch.from_numpy(np.repeat(np.arange(len(query_lens)), query_lens)).to(hidden.device)
            rows = hidden.float()
            if method == "mean":  # np.array: query_lens may be a read-only view, torch warns on those
                sums = rows.new_zeros(len(query_lens), rows.shape[1]).index_add_(0, seq, rows)
                vectors = sums / torch.from_numpy(np.array(query_lens)).to(sums)[:, None]
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
        for weight, bias, activation in self.dense:
            vectors = activation(F.linear(vectors, weight.to(vectors.device), bias))
        if self.config.normalize:
            vectors = F.normalize(vectors, p=2.0, dim=-1)
        return vectors.reshape(-1).cpu().tolist()


def _dense_weights(folder: Path, module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Dense module's linear.weight [out, in] and linear.bias, as float32; ValueError naming the file
    when they are missing or of the wrong shape."""
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        path = folder / "model.safetensors"
        tensors = load_file(path)
    elif (folder / "pytorch_model.bin").is_file():
        path = folder / "pytorch_model.bin"
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder}: no model.safetensors or pytorch_model.bin for its Dense module")
    weight, bias = tensors.get("linear.weight"), tensors.get("linear.bias")
    if weight is None or tuple(weight.shape) != (module.out_features, module.in_features):
        raise ValueError(f"{path}: linear.weight is not [{module.out_features}, {module.in_features}]")
    if module.bias and (bias is None or tuple(bias.shape) != (module.out_features,)):
        raise ValueError(f"{path}: linear.bias is not [{module.out_features}]")
    return weight.float(), bias.float() if module.bias else None


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
