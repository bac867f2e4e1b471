"""At most max_loras distinct LoRA adapters in one step (vLLM's --max-loras).

The workers run one grouped product per adapter in the step, so the scheduler caps how many adapters the
running batch holds. Base-model sequences ("" adapter) are never limited. Plain Python: no torch, no gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from scheduler.sequence import Sequence


def fits(seq: Sequence, running: list[Sequence], max_loras: int) -> bool:
    """Whether running seq beside `running` keeps the step within max_loras distinct adapters."""
    if not seq.lora_name:
        return True
    used = {s.lora_name for s in running if s.lora_name}
    return seq.lora_name in used or len(used) < max_loras


def within_max_loras(
    order: Iterable[Sequence], running: list[Sequence], max_loras: int
) -> Iterator[Sequence]:
    """The waiting sequences of `order` that may be admitted, checked one at a time against `running` as
    it is when each is reached (the caller admits between them). Once a sequence on an adapter is passed
    over, every later one on an adapter is too: only base-model sequences go past it, so the running
    adapters drain and it comes next (none starves)."""
    blocked = False
    for seq in order:
        if seq.lora_name and (blocked or not fits(seq, running, max_loras)):
            blocked = True
            continue
        yield seq
