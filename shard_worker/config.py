"""The shard worker's configuration: built once from the command line, validated, frozen.

Each field declared with `setting` is also the flag of the same name (common/settings.py); those marked
launch=True are taken by `tpserve launch` too and given to every rank.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import gguf_model, metrics, security, settings, tracing
from common.security import TlsFiles
from common.settings import at_least, setting
from common.tracing import TracingConfig
from shard_worker.devices import usable_cores
from shard_worker.startup import DEFAULT_COMPILE_CACHE_DIR

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEVICES = ("cpu", "cuda")
# shard_worker/devices.py's linear_dtype: dtype (the default) keeps the linear layers in --dtype.
LINEAR_DTYPES = ("dtype", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")
# shard_worker/model/quant/__init__.py: none, or an online format.
QUANTIZATION_CHOICES = ("none", "int8", "fp8")
# shard_worker/attention/__init__.py: auto is triton on CUDA, cpu on CPU (flex without a C++ compiler),
# reference for float64.
ATTENTION_BACKENDS = ("auto", "cpu", "flex", "triton", "reference")
# shard_worker/attention/kv_dtype.py: auto is --dtype.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class WorkerConfig:
    model: str = setting(help="Hugging Face checkpoint directory, or a .gguf file", launch=True)
    tokenizer: str | None = setting(
        None, help="with a .gguf --model: the tokenizer's directory (default: the file's own)", launch=True
    )
    rank: int = setting(0, help="this worker's rank in the tensor-parallel group", rule=at_least(0))
    world_size: int = setting(1, help="tensor-parallel size", rule=at_least(1))
    # host:port of rank 0's torch.distributed store; needed when world_size > 1.
    dist_init: str = setting("", help="HOST:PORT of rank 0's torch.distributed store")
    host: str = setting("127.0.0.1", help="address to bind (loopback unless told otherwise)")
    port: int = setting(0, help="0: any free port (see --port-file)", rule=at_least(0))
    port_file: str | None = setting(None, help="write the bound port here once serving")
    device: str = setting(
        "cpu", help="cpu, or cuda (rank r takes cuda:<r % devices>)", choices=DEVICES, launch=True
    )
    # auto is the default of the workers and of `tpserve launch` alike (vLLM's): the fast type here. An
    # explicit dtype is exactly that dtype in every layer (--linear-dtype only opts out for the linears).
    dtype: str = setting(
        "auto",
        help="weights, activations and KV cache, in every layer; auto (logged at start with the reason): "
        "bfloat16 on CPUs that multiply it natively (AVX-512 BF16, AMX) and on GPUs that have it, float16 "
        "on older GPUs, float32 on other CPUs",
        choices=DTYPES,
        launch=True,
    )
    linear_dtype: str = setting(
        "dtype",
        help="weights of the projections, MLPs and LM head: dtype (as --dtype), or bfloat16, an explicit "
        "opt-in for a float32 model (inputs rounded to bf16 for each product, products back in --dtype: "
        "faster on CPUs with native bf16, no longer float32's results)",
        choices=LINEAR_DTYPES,
        launch=True,
    )
    quantization: str = setting(
        "none",
        help="quantize an unquantized checkpoint's linear layers while it loads: int8 (weight-only, "
        "symmetric per output channel) or fp8 (e4m3 weights, a scale per output channel); none: the "
        "checkpoint's own format (config.json's quantization_config, if any)",
        choices=QUANTIZATION_CHOICES,
        launch=True,
    )
    num_threads: int = setting(
        0,
        help="torch CPU threads (0: the cores but one for steps under 32 tokens, every core for larger "
        "ones, shared by the ranks: small steps lose more to the router's, the scheduler's and gRPC's "
        "interruptions than a second thread gains them; cores: those the worker may run on, capped by its "
        "container's CPU limit)",
        rule=at_least(0),
        launch=True,
    )
    load_format: str = setting(
        "auto",
        help="auto: the checkpoint's weights; dummy: random weights from config.json alone (benchmarks at "
        "real shapes, no checkpoint on disk)",
        choices=LOAD_FORMATS,
        launch=True,
    )
    attention_backend: str = setting(
        "auto",
        help="auto (triton on CUDA, cpu on CPU, reference in float64), cpu (our C++ paged kernel for "
        "decodes, SDPA for prefills; float32, bfloat16, float16), flex (CPU float32), triton, or reference "
        "(one sequence at a time: exact, slow); gpt-oss's attention sinks: all but flex",
        choices=ATTENTION_BACKENDS,
        launch=True,
    )
    speculative_model: str | None = setting(
        None,
        help="speculative decoding's draft model: a smaller checkpoint with the model's vocabulary, run on "
        "the same ranks (with the scheduler's --speculative-method draft)",
        launch=True,
    )
    # Both flags, as in vLLM: --enforce-eager is the name people know; --no-cuda-graphs says what it does.
    cuda_graphs: bool = setting(
        True,
        help="replay decode steps from CUDA graphs captured at start-up per batch-size bucket (CUDA only: "
        "ignored on CPU, which has no graphs)",
        launch=True,
    )
    enforce_eager: bool = setting(False, help="run every step eagerly: no CUDA graphs", launch=True)
    kv_cache_dtype: str = setting(
        "auto",
        help="the KV cache's elements (vLLM's names): auto (--dtype), bfloat16, fp8_e4m3 (scaled by the "
        "checkpoint's per-layer k_scale/v_scale, else 1) or fp8_e5m2; stored rounded, read in --dtype. "
        "CPU only",
        choices=KV_CACHE_DTYPES,
        launch=True,
    )
    compile_cache_dir: str = setting(
        DEFAULT_COMPILE_CACHE_DIR,
        help="where compiled kernels (torch.compile: inductor's FX graph and AOT autograd caches) are kept "
        "across starts, so a restart loads them instead of compiling; empty: a fresh temporary directory "
        "each start (nothing reused)",
        launch=True,
    )
    # Multi-LoRA (vLLM's flags): adapters read at start, each served by the OpenAI `model` name.
    enable_lora: bool = setting(
        False, help="serve LoRA adapters (--lora-modules) beside the base model", launch=True
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        help="a LoRA adapter to serve, NAME=PATH (a PEFT directory: adapter_config.json and "
        "adapter_model.safetensors); repeatable, or several after one flag",
        launch=True,
    )
    max_lora_rank: int = setting(
        16,
        help="the highest LoRA rank served; a higher one is refused at load",
        rule=at_least(1),
        launch=True,
    )
    max_loras: int = setting(
        4,
        help="most distinct LoRA adapters in one step: each rank's device slots of adapter weights",
        rule=at_least(1),
        launch=True,
    )
    max_cpu_loras: int = setting(
        0,
        help="LoRA adapters kept read on the host (the least recently used evicted, read again from its "
        "path when a request needs it); 0: --max-loras (vLLM's default); at least --max-loras",
        rule=at_least(0),
        launch=True,
    )
    runner: str = setting(
        "auto",
        help="generate (Generate is served), pooling (Embed and Score: embeddings, cross-encoder scores), "
        "or auto: pooling for an encoder architecture, a *ForSequenceClassification head or a "
        "sentence-transformers checkpoint (modules.json), generate otherwise",
        choices=("auto", "generate", "pooling"),
        launch=True,
    )
    metrics_port: int | None = None
    tracing: TracingConfig = TracingConfig()
    internal_tls: TlsFiles | None = None  # mutual TLS: only a scheduler with a certificate gets in

    def __post_init__(self):
        settings.validate(self)
        # A .gguf file becomes a directory of its config and tokenizer (common/gguf_model.py).
        object.__setattr__(self, "model", gguf_model.model_dir(self.model, self.tokenizer))
        if self.speculative_model and not (Path(self.speculative_model) / "config.json").is_file():
            raise ValueError(f"--speculative-model {self.speculative_model}: no config.json there")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if 0 < self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras {self.max_cpu_loras} must be at least --max-loras {self.max_loras}"
            )
        if not self.rank < self.world_size:
            raise ValueError(f"--rank {self.rank} must be in [0, --world-size {self.world_size})")
        if self.world_size > 1 and ":" not in self.dist_init:
            raise ValueError("--dist-init HOST:PORT is required when --world-size > 1")

    @property
    def use_cuda_graphs(self) -> bool:
        return self.cuda_graphs and not self.enforce_eager and self.device == "cuda"

    @property
    def threads(self) -> int:
        """torch threads for small steps (and every step, when --num-threads is given)."""
        if self.num_threads > 0:
            return self.num_threads
        return default_threads(usable_cores(), self.world_size)

    @property
    def big_step_threads(self) -> int:
        """torch threads for steps of BIG_STEP_TOKENS tokens or more."""
        if self.num_threads > 0:
            return self.num_threads
        return max(1, usable_cores() // self.world_size)


def default_threads(cores: int, world_size: int) -> int:
    """One core is left to the other processes: on 2 cores under the whole stack, a worker with 1
    thread served SmolLM2 25-30% faster (TPOT at concurrency 1 and 8, vllm bench serve) than with 2,
    whose threads stalled at every op's barrier while the router and scheduler ran (vLLM reserves one
    core the same way). Large steps take every core (StepThreads)."""
    return max(1, (cores - 1) // world_size)


# A step of this many tokens or more runs on big_step_threads. On 2 cores, SmolLM2 under the whole stack
# (vllm bench serve, one run each): 2 threads against 1 gave the same at concurrency 8, 1.06x the output
# throughput at 32 and 1.34x in a burst of 384 (batches of ~128 and prefill chunks).
BIG_STEP_TOKENS = 32


class StepThreads:
    """Sets torch's CPU threads for each step: `small` under BIG_STEP_TOKENS tokens, `big` from there on.
    Hysteresis (back to small only under half the threshold) keeps a batch that hovers at it from
    switching every step; a switch costs ~70 us. set_threads: torch.set_num_threads, or a test's fake."""

    def __init__(self, small: int, big: int, set_threads):
        self.small, self.big = small, big
        self._set = set_threads
        self.current: int | None = None

    def before_step(self, num_tokens: int) -> int:
        want = self.current if self.current is not None else self.small
        if num_tokens >= BIG_STEP_TOKENS:
            want = self.big
        elif num_tokens < BIG_STEP_TOKENS // 2:
            want = self.small
        if want != self.current:
            self._set(want)
            self.current = want
        return want


def add_arguments(p: argparse.ArgumentParser) -> None:
    settings.add_arguments(p, WorkerConfig)
    security.add_internal_arguments(p)
    metrics.add_arguments(p)
    tracing.add_arguments(p)


def from_args(a: argparse.Namespace) -> WorkerConfig:
    return settings.from_args(
        WorkerConfig,
        a,
        metrics_port=a.metrics_port,
        tracing=tracing.from_args(a),
        internal_tls=security.internal_from_args(a),
    )
