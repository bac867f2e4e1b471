"""Pooling as plain logic: the scheduler's pooling sequences (one whole step, nothing sampled, blocks back at
once, batched with generation), the checkpoint's pooling config, and the router's vector arithmetic."""

import json

import pytest

from common.pb.tpserve.v1.generation_pb2 import FINISH_REASON_LENGTH
from common.pooling import pooling_config, resolve_runner
from router.embedding import _cosine, _matryoshka
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.sequence import Sequence
from tests.unit.fakes import one_each

BS = 16


def make(budget=64, num_blocks=64, prefix=False):
    policy = SchedulingPolicy(max_model_len=512, max_num_batched_tokens=budget)
    return Scheduler(policy, BlockManager(num_blocks, BS, enable_prefix_caching=prefix), eos_token_ids=[2])


def pooled(i, n):
    return Sequence(i, f"p{i}", [10 + (i + j) % 50 for j in range(n)], n, 0, pooling=True)


def generating(i, n, new=3):
    return Sequence(i, f"g{i}", [10 + (i + j) % 50 for j in range(n)], n, new)


def test_pooling_runs_whole_in_one_step_with_generation_and_frees_its_blocks():
    sched = make(budget=64)
    sched.add(generating(0, 20))
    sched.add(pooled(1, 30))
    sched.add(pooled(2, 30))  # 20 + 30 + 30 > 64: waits whole for the next step, never chunked
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.num_samples) for s in out.scheduled] == [
        ("g0", 20, 1),
        ("p1", 30, 0),
    ]
    updates = sched.update(out, one_each([50]))
    assert [(u.seq.request_id, u.new_tokens, u.finished) for u in updates] == [
        ("g0", [50], False),
        ("p1", [], True),
    ]
    assert updates[1].seq.finish_reason == FINISH_REASON_LENGTH
    sched.check_invariants()
    assert sched.blocks.counts()["kv_blocks_free"] == 64 - 2  # only g0's two blocks are held
    out = sched.schedule()  # g0 decodes beside p2's whole prompt
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("g0", 1), ("p2", 30)]
    sched.update(out, one_each([51]))
    assert not sched.has_request("p2")


def test_pooling_never_reads_nor_fills_the_prefix_cache():
    sched = make(budget=256, prefix=True)
    sched.add(generating(0, 48))  # its full blocks are registered for reuse once computed
    sched.update(sched.schedule(), one_each([50]))
    again = pooled(1, 48)
    again.token_ids = list(sched.get("g0").token_ids[:48])  # the same prompt: computed whole all the same
    sched.add(again)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("g0", 1), ("p1", 48)]
    cached = sched.blocks.counts()["prefix_cache_blocks"]
    sched.update(out, one_each([51]))
    assert sched.blocks.counts()["prefix_cache_blocks"] == cached  # p1 registered nothing
    sched.check_invariants()


def test_a_pooling_prompt_over_the_step_budget_is_refused_with_the_limit():
    from common.pb.tpserve.internal.v1 import scheduler_pb2
    from scheduler.add_request import RequestError, sequence_for

    msg = scheduler_pb2.AddRequest(request_id="x", prompt_token_ids=[5] * 65, pooling=True)
    with pytest.raises(RequestError, match="65 tokens exceeds --max-num-batched-tokens 64"):
        sequence_for(msg, make(budget=64), 0, ())


def _write(path, name, obj):
    path.joinpath(name).parent.mkdir(parents=True, exist_ok=True)
    path.joinpath(name).write_text(json.dumps(obj))


def test_runner_and_pooling_are_read_from_the_checkpoint(tmp_path):
    _write(tmp_path, "config.json", {"architectures": ["Qwen3ForCausalLM"]})
    assert resolve_runner("auto", tmp_path) == "generate"
    _write(
        tmp_path,
        "modules.json",
        [
            {"path": "", "type": "sentence_transformers.models.Transformer"},
            {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    _write(tmp_path, "1_Pooling/config.json", {"pooling_mode_lasttoken": True})
    _write(tmp_path, "sentence_bert_config.json", {"max_seq_length": 256})
    assert resolve_runner("auto", tmp_path) == "pooling"
    config = pooling_config(tmp_path)
    assert (config.method, config.normalize, config.max_seq_length) == ("last", True, 256)
    _write(tmp_path, "config.json", {"architectures": ["BertForSequenceClassification"], "num_labels": 1})
    assert pooling_config(tmp_path).activation == "sigmoid"
    with pytest.raises(ValueError, match="no language-model head"):
        resolve_runner("generate", tmp_path)
    _write(tmp_path, "config.json", {"architectures": ["BertModel"]})
    _write(tmp_path, "modules.json", [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}])
    _write(tmp_path, "2_Dense/config.json", {"in_features": 8, "out_features": 4, "bias": False})
    (dense,) = pooling_config(tmp_path).dense  # Dense's default activation: Tanh
    assert (dense.path, dense.in_features, dense.out_features, dense.bias, dense.activation) == (
        "2_Dense", 8, 4, False, "tanh",
    )  # fmt: skip
    bad = {"in_features": 8, "out_features": 4, "activation_function": "x.Y"}
    _write(tmp_path, "2_Dense/config.json", bad)
    with pytest.raises(ValueError, match="activation_function 'x.Y' is not served"):
        pooling_config(tmp_path)
    norm = {"path": "3_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}
    _write(tmp_path, "modules.json", [norm])
    with pytest.raises(ValueError, match="LayerNorm module"):
        pooling_config(tmp_path)


def test_matryoshka_keeps_unit_length_and_cosine():
    v = [0.6, 0.0, 0.8, 0.0]
    assert _matryoshka(v, 2) == [1.0, 0.0]
    assert _matryoshka([3.0, 4.0, 5.0], 2) == [3.0, 4.0]  # not normalized: left as is
    assert _cosine([1.0, 0.0], [1.0, 1.0]) == pytest.approx(2**-0.5)


def test_a_replica_refuses_the_other_runners_requests_in_one_line():
    from common.pb.tpserve.internal.v1 import scheduler_pb2
    from common.pb.tpserve.v1 import generation_pb2
    from scheduler.add_request import RequestError, sequence_for

    pooling = generation_pb2.ModelInfo(model_name="minilm", runner="pooling")
    generate = scheduler_pb2.AddRequest(request_id="g", prompt_token_ids=[5, 6], max_new_tokens=2)
    with pytest.raises(
        RequestError, match=r"^minilm is served for pooling \(Embed, Score, /v1/embeddings\) only$"
    ):
        sequence_for(generate, make(), 0, (), pooling)
    embed = scheduler_pb2.AddRequest(request_id="p", prompt_token_ids=[5, 6], pooling=True)
    with pytest.raises(RequestError, match="^smollm2 is served for generation only$"):
        sequence_for(embed, make(), 0, (), generation_pb2.ModelInfo(model_name="smollm2", runner="generate"))
    assert sequence_for(embed, make(), 0, (), pooling).pooling
