"""Decoder-only sequence classifiers (Qwen3ForSequenceClassification, LlamaForSequenceClassification):
a served decoder family's body, its final norm's output at each prompt's last token through `score` (a
linear to num_labels, no bias), as transformers computes them, served for pooling as cross-encoders.

This is Qwen3-Reranker's shape once converted as vLLM and sentence-transformers convert it (the seq-cls
checkpoints): its yes/no reading, sigmoid(logit[yes] - logit[no]) at the last token, is a one-label head
whose row is lm_head[yes] - lm_head[no], through the sigmoid a one-label cross-encoder gets. The prompt
template (instruction, query, document) is the client's to apply, as with vLLM.

score is whole on every rank (rank 0 pools); the body is tensor parallel as the family's CausalLM.
"""

from __future__ import annotations

from torch import nn

from shard_worker.model.base import CausalLM


def sequence_classifier(causal: type[CausalLM]) -> type[CausalLM]:
    """causal's family with `score` in place of its language-model head."""

    class SequenceClassifier(causal):
        cross_encoder = True

        def __init__(self, config, tp):
            super().__init__(config, tp)
            del self.lm_head  # not in the checkpoint: score reads the last token instead
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

        @classmethod
        def config_from_hf(cls, hf, architecture: str, eos_ids=()):
            config = super().config_from_hf(hf, architecture, eos_ids)
            object.__setattr__(config, "num_labels", hf.num_labels)  # read by the pooler (its size)
            return config

        def forward(self, input_ids, positions, ctx, kv_caches, token_type_ids=None):
            return super().forward(input_ids, positions, ctx, kv_caches)  # no token types in a decoder

        def compute_logits(self, hidden_rows):
            return None  # nothing is sampled

        def classify(self, last_rows):
            return self.score(last_rows)

    SequenceClassifier.__name__ = causal.__name__.replace("ForCausalLM", "ForSequenceClassification")
    SequenceClassifier.__qualname__ = SequenceClassifier.__name__
    return SequenceClassifier
