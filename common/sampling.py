"""Sampling parameters as plain values, with the defaults the public API promises.

The proto's optional fields say whether a value was set; this turns them into one frozen object that
the router validates and the shard worker samples with, so both agree on every default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from common.grammar import GrammarSpec
from common.reasoning import ReasoningSpec

# The optional fields of tpserve.v1.SamplingParams, in proto order: the client, the CLI and the
# worker's config all iterate over these.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


# generation_config.json fields a checkpoint may set as its sampling defaults (same names as ours).
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # (token id, bias) pairs, sorted by id: frozen and hashable, unlike a dict.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # Token sequences never to complete (bad_words, tokenized by the router).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # The grammar the output must follow (structured outputs); None: free text.
    structured: GrammarSpec | None = None
    # The think block of a reasoning model (thinking budget; a grammar starts after it); None: no parser.
    reasoning: ReasoningSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def to_proto(self):
        """A tpserve.v1.SamplingParams with every field set: what the router validated (and resolved,
        e.g. a vanishing temperature made greedy) is what the worker samples with."""
        from common.pb.tpserve.v1 import generation_pb2

        values = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        if values["seed"] is None:
            del values["seed"]
        return generation_pb2.SamplingParams(
            **values,
            logit_bias=dict(self.logit_bias),
            min_tokens=self.min_tokens,
            bad_words_token_ids=[generation_pb2.TokenIds(ids=ids) for ids in self.bad_words_token_ids],
            structured_output=self.structured.to_proto() if self.structured is not None else None,
            reasoning=self.reasoning.to_proto() if self.reasoning is not None else None,
        )

    @classmethod
    def from_proto(cls, msg, defaults: SamplingConfig | None = None) -> SamplingConfig:
        """Builds from a tpserve.v1.SamplingParams; unset fields take `defaults` (the model's, see
        model_defaults), or the defaults above."""
        values = {}
        for name in SAMPLING_FIELDS:
            if msg.HasField(name):
                values[name] = getattr(msg, name)
        if msg.logit_bias:
            values["logit_bias"] = tuple(sorted(msg.logit_bias.items()))
        if msg.HasField("min_tokens"):
            values["min_tokens"] = msg.min_tokens
        if msg.bad_words_token_ids:
            values["bad_words_token_ids"] = tuple(tuple(t.ids) for t in msg.bad_words_token_ids)
        if msg.HasField("structured_output"):
            values["structured"] = GrammarSpec.from_proto(msg.structured_output)
        if msg.HasField("reasoning"):
            values["reasoning"] = ReasoningSpec.from_proto(msg.reasoning)
        return dataclasses.replace(defaults, **values) if defaults is not None else cls(**values)

    @classmethod
    def model_defaults(cls, model_dir: str | Path) -> SamplingConfig:
        """The checkpoint authors' sampling defaults from its generation_config.json (temperature, top_p,
        top_k, min_p, repetition_penalty), for fields a request leaves unset, as vLLM applies them;
        the API's defaults for whatever it does not say."""
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        config = json.loads(path.read_text())
        values = {name: config[name] for name in MODEL_DEFAULT_FIELDS if config.get(name) is not None}
        return cls(**values)
