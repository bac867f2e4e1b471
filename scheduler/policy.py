"""The knobs of batch forming (SchedulingPolicy), declared once: `tpserve scheduler` and `tpserve launch`
take them as flags (common/settings.py). Plain Python."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import at_least, setting, validate

BATCHING_MODES = ("continuous", "static")


@dataclass(frozen=True)
class SchedulingPolicy:
    """The knobs of batch forming. Each is declared here once: `tpserve scheduler` and `tpserve launch`
    take them as flags (see common/settings.py)."""

    max_num_seqs: int = setting(128, help="most sequences in one step's batch", rule=at_least(1), launch=True)
    max_num_batched_tokens: int = setting(
        2048, help="token budget of one step (prefill chunks plus decodes)", rule=at_least(1), launch=True
    )
    max_model_len: int = setting(
        0,
        help="most tokens (prompt + output) per sequence (0: the model's context, capped by the KV pool)",
        rule=at_least(0),
        launch=True,
    )
    batching: str = setting(
        "continuous", help="continuous, or static (the baseline)", choices=BATCHING_MODES, launch=True
    )
    static_batch_size: int = setting(
        32, help="static batching: requests per batch", rule=at_least(1), launch=True
    )
    static_batch_timeout_ms: float = setting(
        50.0,
        help="static batching: longest wait for a batch to fill before a partial one starts",
        rule=at_least(0),
        launch=True,
    )
    min_batch_size: int = setting(
        8,
        help="with --batch-wait-timeout-ms: a smaller batch waits for requests on their way",
        rule=at_least(1),
        launch=True,
    )
    batch_wait_timeout_ms: float = setting(
        0.0, help="longest wait for min_batch_size sequences (0: never wait)", rule=at_least(0), launch=True
    )
    max_loras: int = setting(
        4,
        help="most distinct LoRA adapters in one step (requests on others wait, the oldest first)",
        rule=at_least(1),
        launch=True,
    )
    # Share of blocks kept free when admitting new sequences, so that admitting one does not force
    # the running ones into preemption at their next token.
    admission_watermark: float = 0.01

    def __post_init__(self):
        validate(self)
