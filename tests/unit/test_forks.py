"""Several choices of one request, and sequences waiting for their grammar, in the scheduler (plain Python):
choices share the first one's full prompt blocks by reference count (each computes its own last, partial
block, so no shared block is ever written), the accounting holds after every step, and the outputs equal
those of choices computed alone; a grammar sequence holds nothing until rank 0 reports it ready."""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import Sequence, SequenceStatus
from tests.unit.fakes import one_each

BS = 16
EOS = 2
PROMPT = [10 + j % 50 for j in range(40)]  # two full blocks, then 8 tokens


def make(num_blocks=64, **policy):
    return Scheduler(SchedulingPolicy(max_model_len=1024, **policy), BlockManager(num_blocks, BS), [EOS])


def choice(i: int, first: Sequence | None = None, max_new: int = 6) -> Sequence:
    return Sequence(i, f"r{i}", list(PROMPT), len(PROMPT), max_new, fork_of=first)


def model(s: Sequence) -> int:
    """Next token from the tokens so far and the choice (its own 'seed'), never from the batch."""
    return 10 + (sum(s.token_ids) * 31 + len(s.token_ids) + 7 * s.seq_id) % 90


def step(sched: Scheduler, outputs: dict, writes: list | None = None) -> None:
    out = sched.schedule()
    if writes is not None:  # the blocks each computed token's KV is written to
        for item in out.scheduled:
            s = item.seq
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + item.num_new_tokens):
                writes.append((s.seq_id, s.block_table[pos // BS]))
    tokens = [model(s.seq) for s in out.scheduled if s.num_samples]
    for u in sched.update(out, one_each(tokens)):
        outputs.setdefault(u.seq.request_id, []).extend(u.new_tokens)
    sched.check_invariants()


def test_choices_share_the_first_ones_full_prompt_blocks_and_never_write_them():
    sched = make()
    first = choice(0)
    sched.add(first)
    others = [choice(i, first) for i in (1, 2)]
    for s in others:
        sched.add(s)
    outputs, writes = {}, []
    step(sched, outputs, writes)
    # The first choice stops at its share point (32 tokens, two full blocks); the others wait.
    assert first.num_computed_tokens == 32 and [s.status for s in others] == [SequenceStatus.WAITING] * 2
    step(sched, outputs, writes)
    shared = first.block_table[:2]
    assert all(s.block_table[:2] == shared for s in others)
    assert [sched.blocks._ref_count[b] for b in shared] == [3, 3]
    # Each choice's partial block is its own: 3 choices hold 2 + 3 blocks, not 3 * 3.
    held = {b for s in [first, *others] for b in s.block_table}
    assert len(held) == 5 and sched.blocks.num_free_blocks == 64 - 5
    while sched.has_unfinished:
        step(sched, outputs, writes)
    # Copy on write is never needed: no choice wrote a block another choice holds.
    assert all(b not in shared or s == 0 for s, b in writes)
    assert sched.blocks.num_free_blocks == 64
    # The same choices alone, each computing its whole prompt: the same tokens.
    for i in range(3):
        alone = make()
        alone.add(Sequence(i, f"r{i}", list(PROMPT), len(PROMPT), 6))
        want = {}
        while alone.has_unfinished:
            step(alone, want)
        assert outputs[f"r{i}"] == want[f"r{i}"]


def test_a_choice_whose_first_is_gone_is_computed_alone():
    sched = make()
    first = choice(0, max_new=1)
    sched.add(first)
    sched.add(later := choice(1, first))
    outputs = {}
    sched.abort("r0")
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [later] and later.fork_of is None
    assert later.num_computed_tokens == 0  # nothing shared: the whole prompt is computed
    sched.update(out, one_each([model(later)]))
    while sched.has_unfinished:
        step(sched, outputs)
    assert len(outputs["r1"]) == 5 and sched.blocks.num_free_blocks == 64
    # A prompt shorter than a block has nothing to share: no waiting at all.
    short = make()
    a = Sequence(0, "a", [11, 12, 13], 3, 2)
    short.add(a)
    short.add(b := Sequence(1, "b", [11, 12, 13], 3, 2, fork_of=a))
    assert b.fork_of is None and len(short.schedule().scheduled) == 2


def test_a_preempted_first_choice_makes_the_others_wait_or_go_alone():
    sched = make(num_blocks=8)
    first = choice(0, max_new=30)
    sched.add(first)
    others = [choice(i, first, max_new=30) for i in (1, 2)]
    for s in others:
        sched.add(s)
    outputs = {}
    for _ in range(200):
        if not sched.has_unfinished:
            break
        step(sched, outputs)
    assert not sched.has_unfinished and sched.num_preemptions > 0
    assert all(len(outputs[f"r{i}"]) == 30 for i in range(3))
    assert sched.blocks.num_free_blocks == 8


def test_a_sequence_waiting_for_its_grammar_holds_nothing_until_ready():
    sched = make()
    g = Sequence(0, "g", list(PROMPT), len(PROMPT), 3, has_grammar=True, grammar_ready=False)
    plain = Sequence(1, "p", list(PROMPT), len(PROMPT), 3)
    sched.add(g)
    sched.add(plain)
    out = sched.schedule()
    # Passed over (not blocking the one behind it), introduced to the workers, holding no blocks.
    assert [s.seq for s in out.scheduled] == [plain] and out.grammar_waiting == [g] and not g.block_table
    sched.update(out, one_each([model(plain)]))
    sched.grammars_ready([0])
    out = sched.schedule()
    assert g in [s.seq for s in out.scheduled] and not out.grammar_waiting
    # Lost ranks: the new rank 0 must compile it again before it runs.
    sched.requeue_all()
    assert not g.grammar_ready and plain.grammar_ready
    out = sched.schedule()
    assert out.grammar_waiting == [g] and g not in [s.seq for s in out.scheduled]
    # Nothing else to do: the step only awaits the grammar.
    sched.abort("p")
    assert sched.schedule().only_grammars
