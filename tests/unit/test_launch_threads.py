"""`tpserve launch --num-threads N` reaches the shard workers (their torch intra-op threads)."""

from common import cli, launcher


def launched_worker_args(monkeypatch, tiny_model, *flags: str) -> tuple[str, ...]:
    seen = []
    monkeypatch.setattr(launcher, "launch", lambda config: seen.append(config) or 0)
    assert cli.main(["launch", "--model", str(tiny_model), *flags]) == 0
    return seen[0].worker_args


def test_threads_given_to_launch_reach_the_workers(monkeypatch, tiny_model):
    args = launched_worker_args(monkeypatch, tiny_model, "--num-threads", "1")
    assert args[args.index("--num-threads") + 1] == "1"


def test_without_the_flag_the_workers_keep_their_own_default(monkeypatch, tiny_model):
    args = launched_worker_args(monkeypatch, tiny_model)
    assert args[args.index("--num-threads") + 1] == "0"  # 0: decided by the worker (default_threads)


def test_by_default_a_worker_leaves_one_core_to_the_other_processes():
    from shard_worker.config import default_threads

    assert [default_threads(c, 1) for c in (1, 2, 8)] == [1, 1, 7]
    assert [default_threads(c, 2) for c in (1, 2, 9)] == [1, 1, 4]


def test_large_steps_take_every_core_and_small_ones_leave_one():
    from shard_worker.config import BIG_STEP_TOKENS, StepThreads, WorkerConfig

    calls: list[int] = []
    threads = StepThreads(1, 2, calls.append)
    sizes = [
        1,
        8,
        BIG_STEP_TOKENS,
        BIG_STEP_TOKENS - 1,
        BIG_STEP_TOKENS // 2,
        BIG_STEP_TOKENS // 2 - 1,
        1,
        200,
    ]
    assert [threads.before_step(n) for n in sizes] == [1, 1, 2, 2, 2, 1, 1, 2]
    assert calls == [1, 2, 1, 2]  # set only when it changes, and hovering near the threshold keeps it
    config = WorkerConfig(model="m")
    assert config.big_step_threads >= config.threads >= 1
    fixed = WorkerConfig(model="m", num_threads=3)
    assert (fixed.threads, fixed.big_step_threads) == (3, 3)
