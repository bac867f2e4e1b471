"""What a request is promised and what a client may ask: latency objectives, priority, their floors.
Plain Python: no gRPC.

Objectives. A request carries a TTFT objective, a TPOT objective (ms; 0: none) and vLLM's priority (lower
is served first). Unset objectives take the server's default for the prompt's length bucket
(--slo-ttft-ms / --slo-tpot-ms: one value for every bucket, or one per bucket, shortest first).

What a client may ask (`asked`). The operator's floors (--min-ttft-objective-ms, --min-tpot-objective-ms):
an objective below them is refused (INVALID_ARGUMENT naming the field and the floor). A priority below
the default (0; lower is served first, and preempts) only from a caller presenting a key from
--priority-api-key-file, when the operator gives one (PERMISSION_DENIED otherwise); without it any caller
may, as in vLLM.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from common.settings import Rule, between, setting
from router.buckets import bucket_name

_MS_ONE = Rule(lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (milliseconds)")
_MS = Rule(lambda v: all(isinstance(x, int) and x >= 0 for x in v), "integers >= 0 (milliseconds)")


@dataclass(frozen=True)
class SloPolicy:
    """Server-wide defaults (the router's and `tpserve launch`'s flags)."""

    slo_ttft_ms: tuple[int, ...] = setting(
        (0,),
        help="default time-to-first-token objective (ms) of a request that sends none: one value, or one "
        "per length bucket, shortest first (0: none); a request predicted to miss it is refused",
        rule=_MS,
        launch=True,
    )
    slo_tpot_ms: tuple[int, ...] = setting(
        (0,),
        help="default time-per-output-token objective (ms), one value or one per length bucket (0: "
        "none); a replica stepping slower than its requests' tightest objective takes no new ones",
        rule=_MS,
        launch=True,
    )
    slo_tpot_margin: float = setting(
        0.9,
        help="a replica takes no new request while its step, grown by what it would take on, exceeds "
        "this share of the tightest TPOT objective it holds (lower: fewer requests' TPOT past it, a "
        "smaller batch)",
        rule=between(0, 1, low_open=True),
        launch=True,
    )
    min_ttft_objective_ms: int = setting(
        0,
        help="the tightest TTFT objective a client may ask (ms; 0: any): a request asking less is "
        "refused with INVALID_ARGUMENT (HTTP 400) naming the field and this floor",
        rule=_MS_ONE,
        launch=True,
    )
    min_tpot_objective_ms: int = setting(
        0,
        help="the tightest TPOT objective a client may ask (ms; 0: any): a request asking less is "
        "refused with INVALID_ARGUMENT (HTTP 400) naming the field and this floor",
        rule=_MS_ONE,
        launch=True,
    )
    # A step's fixed cost (weights read once for the whole batch) in sequences' worth: a step of n sequences
    # takes about (n + fixed_sequences) units. SmolLM2 on 2 CPU cores in bf16: 45, 71 and 140 ms at 1, 8
    # and 32 sequences (TPOT p50, session 8), about 14; taken lower, so the growth is overestimated.
    fixed_sequences: float = 8.0
    alpha: float = 0.2  # EWMA weight of each new measurement
    # The TTFT prediction's scale: this quantile of the last `window` ratios of actual to predicted TTFT;
    # the TPOT gate's: this quantile of the last `window` ratios of a request's TPOT to its replica's step.
    ttft_quantile: float = 0.97
    tpot_quantile: float = 0.97
    window: int = 64

    def check(self, num_buckets: int) -> None:
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if len(v) not in (0, 1, num_buckets):
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} takes one value or one per length bucket ({num_buckets}), got {len(v)}"
                )


@dataclass(frozen=True)
class Objectives:
    """What one request is promised. Seconds; None: no objective."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    priority: int = 0
    tpot_asked: bool = False  # the TPOT objective is the client's own (not the server's default)

    @property
    def any(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


def _default(values: tuple[int, ...], bucket: int) -> int:
    if not values:
        return 0
    return values[0] if len(values) == 1 else values[min(bucket, len(values) - 1)]


def resolve(
    policy: SloPolicy, bucket: int, ttft_ms: int | None, tpot_ms: int | None, priority: int
) -> Objectives:
    """A request's objectives: what it sent (None: not sent), else its bucket's default; 0 is none."""
    ttft = _default(policy.slo_ttft_ms, bucket) if ttft_ms is None else ttft_ms
    tpot = _default(policy.slo_tpot_ms, bucket) if tpot_ms is None else tpot_ms
    asked = bool(tpot_ms)
    return Objectives(ttft / 1000 if ttft else None, tpot / 1000 if tpot else None, priority, asked)


def below_floor(policy: SloPolicy, ttft_ms: int | None, tpot_ms: int | None) -> tuple[str, str] | None:
    """(field, message) when a client asks an objective tighter than the operator's floor; None: fine.
    0 (no objective) is never below it: a request that asks none is promised nothing."""
    for name, value, floor in (
        ("ttft_objective_ms", ttft_ms, policy.min_ttft_objective_ms),
        ("tpot_objective_ms", tpot_ms, policy.min_tpot_objective_ms),
    ):
        if value and value < floor:
            flag = "--min-" + name.replace("_objective_ms", "-objective-ms")
            return name, f"{name} {value} is below {floor}, the tightest this server accepts ({flag})"
    return None


NO_OBJECTIVES = Objectives()


def ttft_budget_ms(objectives: Objectives, waited_s: float) -> int:
    """What is left of the TTFT objective after waiting waited_s in the router (at least 1 ms; 0: none):
    the scheduler's deadline for the first token is its arrival there plus this."""
    if objectives.ttft_s is None:
        return 0
    return max(1, round((objectives.ttft_s - waited_s) * 1000))


class NotAllowed(Exception):
    """A client asked what it may not, naming the field: status INVALID_ARGUMENT (below a floor, or a
    TPOT objective no step meets: router/slo.py TpotInfeasible) or PERMISSION_DENIED (a priority it is
    not granted), as the gRPC status code's name."""

    def __init__(self, field: str, message: str, permission: bool = False):
        super().__init__(message)
        self.field, self.permission = field, permission
        self.status = "PERMISSION_DENIED" if permission else "INVALID_ARGUMENT"


def asked(
    policy: SloPolicy,
    bucket: int,
    ttft_ms: int | None,
    tpot_ms: int | None,
    priority: int,
    may_prioritize: bool = True,
) -> Objectives:
    """The request's objectives (resolve), once what it asks is allowed: NotAllowed otherwise.
    may_prioritize: the caller may ask a priority below the default."""
    floor = below_floor(policy, ttft_ms, tpot_ms)
    if floor is not None:
        raise NotAllowed(*floor)
    if priority < 0 and not may_prioritize:
        raise NotAllowed(
            "priority",
            f"priority {priority} is below the default 0 (served before others); only callers with a key "
            "from the router's --priority-api-key-file may ask for it",
            permission=True,
        )
    return resolve(policy, bucket, ttft_ms, tpot_ms, priority)


def for_request(
    policy: SloPolicy, edges: tuple[int, ...], request, prompt_tokens: int, may_prioritize: bool = True
) -> tuple[Objectives, str]:
    """A GenerateRequest's objectives (`asked`: its own, else its length bucket's defaults) and the name of
    that bucket (edges: --bucket-edges)."""
    b = bisect_right(edges, prompt_tokens)
    name = bucket_name(edges[b - 1] if b else 0, edges[b] if b < len(edges) else None)
    ttft = request.ttft_objective_ms if request.HasField("ttft_objective_ms") else None
    tpot = request.tpot_objective_ms if request.HasField("tpot_objective_ms") else None
    return asked(policy, b, ttft, tpot, request.priority, may_prioritize), name
