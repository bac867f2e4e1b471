"""BERT-style encoders, served for pooling: BertModel (all-MiniLM, bge, e5), BertForSequenceClassification
(ms-marco cross-encoders), and XLM-RoBERTa's two (bge-m3, bge-reranker), which differ only in their
position ids (offset past padding_idx) and their classification head.

Post-norm layers over absolute position and token-type embeddings; attention is bidirectional within each
sequence. An encoder keeps no KV: a pooling sequence's whole prompt is computed in its one step
(scheduler.proto AddRequest.pooling), so each layer attends densely over that step's tokens of each
sequence (sequences grouped by length, each group padded to its longest, keys masked: EncoderPlan) and
the paged backends are not involved. The scheduler still
counts blocks for it (they bound what one step holds): the cache is one placeholder element per block.

Tensor parallel as the decoders: q/k/v and the intermediate layer column-parallel, the attention output
and the output layer row-parallel (all-reduced), the word embedding vocab-parallel; position and token-type
embeddings, the norms and the heads are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shard_worker.model.config import ModelConfig, refuse_if_set
from shard_worker.model.layers.embedding import VocabParallelEmbedding
from shard_worker.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shard_worker.parallel import TensorParallel


def _config(hf, architecture: str, eos_ids) -> ModelConfig:
    refuse_if_set(hf, "is_decoder")
    if getattr(hf, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {hf.position_embedding_type!r} is not supported")
    if hf.hidden_act not in ("gelu", "gelu_new", "relu"):
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported; supported: gelu, gelu_new, relu")
    head_dim = hf.hidden_size // hf.num_attention_heads
    pad = getattr(hf, "pad_token_id", 0) or 0
    # XLM-R numbers positions from padding_idx + 1: its table's first pad + 1 rows are never reached.
    offset = pad + 1 if architecture.startswith("XLMRoberta") else 0
    config = ModelConfig(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        rms_norm_eps=hf.layer_norm_eps,  # a LayerNorm's eps here
        max_position_embeddings=hf.max_position_embeddings - offset,
        hidden_act=hf.hidden_act,
        qkv_bias=True,
        o_bias=True,
        tie_word_embeddings=False,
        eos_token_ids=(),
        sliding_windows=(None,) * hf.num_hidden_layers,
        rotary=(),
    )
    # Read by the model only: what ModelConfig's fields do not say.
    object.__setattr__(config, "type_vocab_size", getattr(hf, "type_vocab_size", 1) or 1)
    object.__setattr__(config, "position_offset", offset)
    object.__setattr__(config, "position_table", hf.max_position_embeddings)
    object.__setattr__(config, "num_labels", getattr(hf, "num_labels", 1))
    return config


# Sequences of a step are padded only to the longest of their length group: a group's lengths are within
# this ratio of its longest, so padding wastes little of attention's quadratic work, and a step of mixed
# lengths makes a few dense products instead of one mostly padding.
GROUP_RATIO = 0.7


@dataclass(frozen=True)
class _Group:
    index: torch.Tensor  # [n, L]: the step rows of the group's sequences, padding pointing at row 0
    mask: torch.Tensor | None  # [n, 1, 1, L]: real keys; None when no sequence is padded
    real: torch.Tensor  # the real positions of the flattened [n * L] padded rows
    rows: torch.Tensor  # the step rows they are (where the output goes)


class EncoderPlan:
    """How a step's sequences attend (each over all of its own rows): the sequences sorted by length and
    cut into groups (GROUP_RATIO), each padded to its longest. Built once a forward, read by every layer."""

    def __init__(self, query_lens, device: torch.device):
        lens = np.asarray(query_lens, dtype=np.int64)
        self.num_rows = int(lens.sum())
        self.whole = len(lens) == 1  # one sequence: attention over the step as it is
        self.groups: list[_Group] = []
        if self.whole:
            return
        starts = np.cumsum(lens) - lens
        order = np.argsort(-lens, kind="stable")
        cut = 0
        for i in range(1, len(order) + 1):
            if i == len(order) or lens[order[i]] < GROUP_RATIO * lens[order[cut]]:
                self.groups.append(_group(lens[order[cut:i]], starts[order[cut:i]], device))
                cut = i

    def attend(self, q, k, v, scale: float) -> torch.Tensor:
        """[T, heads, head_dim] from q, k, v [T, heads, head_dim]."""
        if self.whole:
            # Two bmm and a softmax, not scaled_dot_product_attention: its CPU kernel took twice as long
            # on one sequence of 10-160 tokens at one thread (0.25 ms against 0.11 at 60 tokens, 12 heads).
            w = torch.bmm(q.transpose(0, 1), k.permute(1, 2, 0)).mul_(scale).softmax(-1, dtype=torch.float32)
            w = w.to(v.dtype)  # softmax in float32 whatever the dtype, as scaled_dot_product_attention
            return torch.bmm(w, v.transpose(0, 1)).transpose(0, 1)
        out = q.new_empty(q.shape)
        for g in self.groups:
            n, length = g.index.shape

            def padded(x, g=g):  # [n, heads, L, head_dim]
                return x[g.index].transpose(1, 2)

            o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=g.mask, scale=scale)
            o = o.transpose(1, 2).reshape(n * length, *q.shape[1:])
            out.index_copy_(0, g.rows, o if g.mask is None else o.index_select(0, g.real))
        return out


def _group(lens: np.ndarray, starts: np.ndarray, device: torch.device) -> _Group:
    longest = int(lens.max())
    cols = np.arange(longest)
    valid = cols[None, :] < lens[:, None]  # [n, L]
    index = np.where(valid, starts[:, None] + cols[None, :], 0)
    real = np.flatnonzero(valid)
    mask = None if valid.all() else torch.from_numpy(valid[:, None, None, :]).to(device)

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)

    return _Group(t(index), mask, t(real), t(index.reshape(-1)[real]))


class _Named(nn.Module):
    """A container named like the checkpoint's module (attention.self, attention.output, ...)."""


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.attention = _Named()
        self.attention.self = _Named()
        qkv = QKVParallelLinear(h, config.head_dim, config.num_heads, config.num_heads, tp, bias=True)
        self.attention.self.qkv_proj = qkv
        self.num_heads = qkv.num_local_heads
        self.attention.output = _Named()
        self.attention.output.dense = RowParallelLinear(config.num_heads * config.head_dim, h, tp, bias=True)
        self.attention.output.LayerNorm = nn.LayerNorm(h, eps=eps)
        self.intermediate = _Named()
        self.intermediate.dense = ColumnParallelLinear(h, config.intermediate_size, tp, bias=True)
        self.output = _Named()
        self.output.dense = RowParallelLinear(config.intermediate_size, h, tp, bias=True)
        self.output.LayerNorm = nn.LayerNorm(h, eps=eps)
        act = config.hidden_act
        self.act = (
            F.relu
            if act == "relu"
            else lambda x: F.gelu(x, approximate="tanh" if act == "gelu_new" else "none")
        )

    def forward(self, h: torch.Tensor, plan: EncoderPlan) -> torch.Tensor:
        qkv = self.attention.self.qkv_proj
        q, k, v = (x.view(-1, self.num_heads, self.head_dim) for x in qkv(h).split(qkv.local_sizes, dim=-1))
        a = plan.attend(q, k, v, self.scale).reshape(h.shape[0], -1)
        h = self.attention.output.LayerNorm(self.attention.output.dense(a) + h)
        i = self.act(self.intermediate.dense(h))
        return self.output.LayerNorm(self.output.dense(i) + h)


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, h, tp)
        self.position_embeddings = nn.Embedding(config.position_table, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, token_type_ids) -> torch.Tensor:
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        e = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(e + self.token_type_embeddings(types))


class BertEncoderBody(nn.Module):
    """Named like the checkpoints (embeddings., encoder.layer.N., pooler.)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, pooler: bool):
        super().__init__()
        self.embeddings = BertEmbeddings(config, tp)
        self.encoder = _Named()
        self.encoder.layer = nn.ModuleList(BertLayer(config, tp) for _ in range(config.num_layers))
        if pooler:  # BERT's pooler: dense + tanh over [CLS] (what its classifier reads)
            self.pooler = _Named()
            self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)


class BertModel(nn.Module):
    """The encoder; its hidden states are pooled as the checkpoint's sentence-transformers files say."""

    packed_modules_mapping: ClassVar[dict] = {
        "query": ("qkv_proj", 0),
        "key": ("qkv_proj", 1),
        "value": ("qkv_proj", 2),
    }
    prefix: ClassVar[str] = ""  # the body's module name in the checkpoint ("bert", "roberta") or none
    cross_encoder: ClassVar[bool] = False
    pooling_only: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.config = config
        self.tp = tp
        body = BertEncoderBody(config, tp, pooler=self.has_pooler())
        if self.prefix:
            setattr(self, self.prefix, body)
        else:
            self.embeddings, self.encoder = body.embeddings, body.encoder
        self.body = [body]  # not a submodule a second time
        self.num_local_kv_heads = 1
        self.head_dim = 1
        self.num_kv_caches = 1
        self.num_kv_layers = config.num_layers  # what a fixed --num-kv-blocks counts in (servicer.py)
        self.offset = config.position_offset

    @classmethod
    def has_pooler(cls) -> bool:
        return False

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """Old files' position_ids buffer; and the pooler's dense, which sentence-transformers'
        embeddings do not use (it is in most BertModel files), unless a classifier reads it."""
        return name.endswith("embeddings.position_ids") or (
            not self.has_pooler() and ".pooler." in f".{name}"
        )

    @classmethod
    def config_from_hf(cls, hf, architecture: str, eos_ids=()) -> ModelConfig:
        return _config(hf, architecture, eos_ids)

    kv_block_dim = 1  # the placeholder's blocks (swap copies along it)
    kv_layout = None  # one layer group (common/kv_cache_spec.py): the placeholder cache below

    def layer_windows(self) -> list[int]:
        return [0]  # one placeholder cache "layer" of full attention: one group, nothing to release

    def layer_latent_dims(self) -> list[int]:
        return [0]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (1, num_blocks)  # a placeholder: no KV is kept (the module docstring)

    def new_kv_caches(self, num_blocks: int, block_size: int, dtype, device, host: bool = False) -> list:
        if host and not num_blocks:
            return []
        return [torch.zeros(self.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=device)]

    def forward(self, input_ids, positions, ctx, kv_caches, token_type_ids=None) -> torch.Tensor:
        body = self.body[0]
        h = body.embeddings(input_ids, positions + self.offset, token_type_ids)
        plan = EncoderPlan(ctx.batch.query_lens_host, h.device)
        for layer in body.encoder.layer:
            h = layer(h, plan)
        return h

    def compute_logits(self, hidden_rows: torch.Tensor) -> None:
        return None  # no language-model head: nothing is sampled

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class BertForSequenceClassification(BertModel):
    """A cross-encoder: [CLS] of `query [SEP] document` through the pooler and the classifier."""

    prefix = "bert"
    cross_encoder = True

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__(config, tp)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @classmethod
    def has_pooler(cls) -> bool:
        return True

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.body[0].pooler.dense(cls_rows)))


class XLMRobertaModel(BertModel):
    """Positions start past padding_idx (config.position_offset), as fairseq numbered them."""

    prefix = ""


class _RobertaHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    prefix = "roberta"
    cross_encoder = True

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__(config, tp)
        self.classifier = _RobertaHead(config)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(cls_rows)))
