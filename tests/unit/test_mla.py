"""Multi-head latent attention (DeepSeek-V3): its cache spec in the block manager and the scheduler with
fake workers (capacity at one budget, preemption by swap), the worker's latent cache (bytes, swap copies
along its block dim), the absorbed and the expanded forms against transformers, and the router."""

from __future__ import annotations

import pytest
import torch

from common.kv_cache_spec import MLASpec, from_describe, group_layers, num_blocks, sequences_held, summary
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler, SchedulingPolicy
from scheduler.swap import HostBlockPool
from shard_worker.attention.latent import LatentAttention
from shard_worker.attention.reference import ReferenceBackend
from tests.model_families import build_checkpoint, hf_config, hf_greedy, prompts
from tests.unit.greedy import new_runner, runner_greedy
from tests.unit.test_kv_cache_spec import GroupedWorker, drive, expected_outputs
from tests.unit.test_scheduler import BS, EOS, seq

torch.set_flush_denormal(True)

# DeepSeek-V3: 61 layers, 128 heads of K 192 (128 + 64 rotated) and V 128, or one latent of 512 + 64.
V3_LAYERS, V3_HEADS, V3_KV_PER_HEAD, V3_LATENT = 61, 128, 192 + 128, 512 + 64


def test_mla_layers_form_one_group_that_keeps_every_block():
    layout = from_describe([0] * 4, BS, [576] * 4)
    assert layout.num_groups == 1 and layout.layers_per_block == 4
    spec = layout.groups[0].spec
    assert spec == MLASpec(BS, 576) and spec.first_needed_block(1000) == 0 and spec.blocks_held(100) == 7
    assert "MLA latent 576 x4" in summary(layout)
    assert from_describe([0] * 4, BS, []) is None  # no latent: the pool as it always was
    with pytest.raises(ValueError):
        group_layers([8, None], BS, [576, 576])  # a window over a latent is not served
    with pytest.raises(ValueError):
        group_layers([None, None], BS, [576, 0])  # pages of two sizes in one pool


def test_latent_capacity_at_one_budget_is_the_bytes_ratio():
    """DeepSeek-V3's real shapes in bf16, 64 GiB of cache: the latent's pages hold 71x the tokens of K and V
    per head, and 79x the 4k sequences at once (3 against 238)."""
    budget, layers = 64 * 2**30, group_layers([None] * V3_LAYERS, BS)
    latent = from_describe([0] * V3_LAYERS, BS, [V3_LATENT] * V3_LAYERS)
    kv_blocks = num_blocks(budget, layers, BS * V3_HEADS * V3_KV_PER_HEAD * 2)
    mla_blocks = num_blocks(budget, latent, BS * V3_LATENT * 2)
    assert (kv_blocks, mla_blocks) == (859, 61119) and mla_blocks // kv_blocks == 71
    assert sequences_held(kv_blocks, layers, 4096) == 3
    assert sequences_held(mla_blocks, latent, 4096) == 238


def mla_scheduler(pool: int, host: int | None = None, **policy) -> Scheduler:
    policy.setdefault("max_model_len", 512)
    policy.setdefault("max_num_batched_tokens", 64)
    layout = from_describe([0] * 3, BS, [40] * 3)
    blocks = BlockManager(pool, BS, layout=layout)
    host_pool = None if host is None else HostBlockPool(host)
    return Scheduler(SchedulingPolicy(**policy), blocks, eos_token_ids=[EOS], host_blocks=host_pool)


def test_more_sequences_run_at_once_in_the_same_bytes():
    """A fake worker checks every key read. At the bytes of 30 blocks of K and V per head (4 heads of 16:
    128 values a token) the latent of 40 values has 96 blocks: 9 sequences of 160 tokens all run, where
    the K/V pool preempts. Outputs are a roomy pool's either way."""

    def run(sched):
        for i in range(9):
            sched.add(seq(i, 100, max_new=60))
        peak = []
        outputs, _ = drive(sched, on_step=lambda s, out: peak.append(len(s.running)))
        assert outputs == expected_outputs(9, lambda i: 100, 60)
        return max(peak), sched.num_preemptions

    layers = group_layers([None] * 3, BS)
    kv_pool = num_blocks(30 * 3 * BS * 128, layers, BS * 128)
    mla_pool = num_blocks(30 * 3 * BS * 128, layers, BS * 40)
    assert (kv_pool, mla_pool) == (30, 96)
    kv = run(
        Scheduler(
            SchedulingPolicy(max_model_len=512, max_num_batched_tokens=64),
            BlockManager(kv_pool, BS),
            eos_token_ids=[EOS],
        )
    )
    mla = run(mla_scheduler(mla_pool, max_num_seqs=9))
    assert kv[0] < 9 and kv[1] > 0 and mla == (9, 0)


def test_a_latent_swapped_out_comes_back_whole():
    sched = mla_scheduler(24, host=64)
    for i in range(6):
        sched.add(seq(i, 30 + 11 * i, max_new=50))
    worker = GroupedWorker(sched.blocks, 64)
    outputs, steps = drive(sched, worker=worker)
    assert any(out.swapped_out for out in steps) and sched.num_preemptions > 0
    assert outputs == expected_outputs(6, lambda i: 30 + 11 * i, 50)
    assert sched.blocks.num_free_blocks == 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = build_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))
    return path, list(hf_greedy(path, 8).values())


def test_the_worker_caches_one_latent_a_token_and_swaps_it(checkpoint):
    path, _ = checkpoint
    runner = new_runner(path, torch.float64)
    c = hf_config("deepseek_v3")
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    assert runner.describe()["layer_latent_dims"] == [latent] * c.num_hidden_layers
    assert runner.kv_block_bytes(BS) == c.num_hidden_layers * BS * latent * 8  # no heads, no V
    assert runner.profile_num_blocks(BS, 64, 0.9, 2**20 / 2**30, 4) == 2**20 // (3 * BS * latent * 8)
    runner.allocate_kv_cache(8, BS)
    runner.allocate_host_kv_cache(4, BS)
    assert [tuple(t.shape) for t in runner.kv_caches] == [(8, BS, latent)] * 3
    for t in runner.kv_caches:
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in runner.kv_caches]
    runner.swap_out([5, 2], [0, 3])
    for t in runner.kv_caches:
        t[[5, 2]] = 0
    runner.swap_in([0, 3], [1, 6])
    for b, t in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(t[[1, 6]], b[[5, 2]]) and torch.equal(t[0], b[0])


@pytest.mark.parametrize("absorb", ["auto", "always", "never"])
def test_absorbed_and_expanded_forms_decode_like_transformers(checkpoint, absorb):
    """Whole prompts in one step (expanded where long, under auto), then decodes (absorbed under auto)."""
    path, reference = checkpoint
    runner = new_runner(path, torch.float64)
    for m in runner.model.modules():
        if isinstance(m, LatentAttention):
            m.absorb = absorb
    assert runner_greedy(runner, prompts(), 8) == reference


def test_one_q_proj_and_plain_rope_as_in_v2_lite_shaped_configs(tmp_path):
    """q_lora_rank None (one q_proj, split by heads), rope not interleaved, no YaRN."""
    path = build_checkpoint(
        "deepseek_v3",
        tmp_path,
        q_lora_rank=None,
        rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    runner = new_runner(path, torch.float64)
    assert runner_greedy(runner, prompts(), 6) == list(hf_greedy(path, 6).values())


def test_float32_on_the_cpu_backend_decodes_like_transformers(checkpoint, tmp_path):
    """auto's backend on CPU in float32 (its contexts carry the tables the latent path reads), and the
    experts' grouped matmul."""
    from transformers import AutoModelForCausalLM

    from tests.unit.greedy import hf_greedy as hf_greedy_model

    path, _ = checkpoint
    runner = new_runner(path, torch.float32)
    assert runner.attention.name == "cpu"
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert runner_greedy(runner, prompts(), 8) == hf_greedy_model(reference, prompts(), 8)


def test_the_multi_token_prediction_layer_is_skipped_and_other_routing_refused(checkpoint, tmp_path):
    """DeepSeek's checkpoints carry the MTP module as layer num_hidden_layers: its tensors load into
    nothing and the model serves; a scoring function other than sigmoid is refused, naming it."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from shard_worker.model.config import ModelConfig

    path, _ = checkpoint
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    mtp = {n.replace("layers.2.", "layers.3."): t.clone() for n, t in tensors.items() if "layers.2." in n}
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert new_runner(tmp_path, torch.float32).config.num_layers == 3
    (tmp_path / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax"}))
    with pytest.raises(ValueError, match="scoring_func 'softmax' is not supported"):
        ModelConfig.from_pretrained(tmp_path)


def test_a_backend_without_mla_refuses_its_layers_in_one_line():
    layer = LatentAttention(4, 32, 8, 16, 12, 0.2)

    class NoMLA(ReferenceBackend):
        supports_mla = False

    assert ReferenceBackend(torch.device("cpu"), torch.float32).refusal(layer) is None
    reason = NoMLA(torch.device("cpu"), torch.float32).refusal(layer)
    assert "cpu, flex or reference" in reason and "\n" not in reason


def test_group_limited_routing_is_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from shard_worker.model.layers.moe import route_grouped

    config = hf_config("deepseek_v3")
    config.n_group, config.topk_group, config.num_experts_per_tok = 4, 2, 3
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    router.weight.data.normal_(0, 0.3)
    router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(50, config.hidden_size)
    logits, want_weights, want_ids = router(x)
    weights, ids = route_grouped(
        logits, router.e_score_correction_bias, 3, 4, 2, True, config.routed_scaling_factor
    )
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.equal(weights.gather(1, order), want_weights.gather(1, want_order))
