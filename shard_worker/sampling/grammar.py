"""The grammar processor (structured outputs, rank 0): only tokens the sequence's grammar allows next can be
chosen. The last processor of the sampler, so greedy's argmax and the draw both see the mask.

Compiling is off the step path: a sequence's grammar is compiled on a thread when the scheduler introduces
the sequence (it holds the sequence in its queue meanwhile), and compiled grammars are cached by spec, so
the next request with the same schema takes a copy in microseconds. The worker tells the scheduler which
grammars are ready (`ready`), and only then is the sequence scheduled.

A sequence's matcher is built from its output tokens so far (replayed into a fresh copy), so a sequence
rebuilt after a lost rank or resumed by another scheduler continues in the same grammar state, as the
penalties do. Preemption keeps the state: the worker keeps the sequence.

Per step: the masks of the step's grammar sequences are filled on the host (llguidance's threads, which
release the GIL) while the forward runs (`prepare`), then unpacked and applied to their logit rows in one
masked fill. When the grammar is complete only EOS is allowed, so the sequence ends there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from common.grammar import GrammarError, GrammarSpec, llguidance_grammar
from shard_worker.sampling.processors import LogitsProcessor, SequenceState
from shard_worker.sampling.thinking import content_ids, inside

log = logging.getLogger("tpserve.shard_worker")

# Compiled grammars kept for reuse (each a few hundred kilobytes at most); live sequences hold copies.
CACHE_SIZE = 256


class GrammarCompiler:
    """Compiles grammars on a thread, for one tokenizer; the results are cached by spec."""

    def __init__(self, tokenizer_dir, vocab_size: int, eos_token_ids, threads: int = 2):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._threads = threads
        self._tokenizer = None  # llguidance's view of the vocabulary: about 1 s to build, once
        self._executor = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._warming: Future | None = None

    def start(self) -> None:
        """Builds llguidance's tokenizer on the compile thread now (about a second), so that the first
        request with a grammar does not wait for it. A model without tokenizer files has none to build:
        its grammars fail when compiled, and say why."""
        if any(
            Path(self.tokenizer_dir, name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            self._warming = self._pool.submit(self._warm)

    def wait_started(self) -> None:
        """Until the tokenizer start() began building is built (or failed): a worker waits before it
        serves, so that its first request does not share the cores with it."""
        if self._warming is not None:
            self._warming.result()

    def _warm(self) -> None:
        try:
            self.tokenizer()
        except Exception as e:  # told again, to the request, when a grammar is compiled
            log.warning("grammar tokenizer not built: %s: %s", type(e).__name__, e)

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(self.tokenizer_dir)
                # The model's EOS ids are what ends a sequence; the grammar allows them once complete.
                eos = self.eos_token_ids or hf.eos_token_id
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
                self._executor = llguidance.LLExecutor(num_threads=self._threads)
            return self._tokenizer

    @property
    def executor(self):
        self.tokenizer()
        return self._executor

    def compiled(self, spec: GrammarSpec) -> Future:
        """A future of spec's matcher in its start state (never consumed from: sequences take copies)."""
        future = self._cache.get(spec)
        if future is None or (future.done() and future.exception() is not None):
            future = self._cache[spec] = self._pool.submit(self._compile, spec)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec)
        return future

    def _compile(self, spec: GrammarSpec):
        from llguidance import LLMatcher

        start = time.perf_counter()
        matcher = LLMatcher(self.tokenizer(), llguidance_grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        # The lexer and parser are built lazily: the first mask is part of compiling, paid here once.
        matcher.compute_bitmask()
        log.debug("grammar %s compiled in %.1f ms", spec.kind, (time.perf_counter() - start) * 1e3)
        return matcher


class _Pending:
    """A sequence whose grammar is still compiling: what its matcher is built from once it is."""

    def __init__(self, future: Future, output_ids: list[int]):
        self.future = future
        self.output_ids = output_ids


class GrammarProcessor(LogitsProcessor):
    def __init__(self, compiler: GrammarCompiler, device: torch.device):
        self.compiler = compiler
        self.device = device
        self._bitmask = np.zeros((0, 0), dtype=np.int32)
        self._prepared: tuple[tuple[int, ...], Future] | None = None
        self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self.mask_seconds = (
            0.0  # critical-path host time on masks (fill wait, unpack, apply), for the metrics
        )
        self.fill_seconds = 0.0  # time llguidance spent filling masks, most of it overlapping the forward

    def wants(self, config):
        return config.structured is not None

    def init(self, state, token_ids, num_prompt_tokens):
        # After a think block only the content is the grammar's (ThinkingProcessor, before this, has
        # replayed the output).
        output = content_ids(state, list(token_ids[num_prompt_tokens:]))
        state.extra["grammar"] = _Pending(self.compiler.compiled(state.config.structured), output)
        self.ready(state)

    def idle(self, state):
        return inside(state)

    def release(self, state):
        state.extra.pop("grammar", None)

    def ready(self, state: SequenceState, timeout: float | None = 0.0) -> bool:
        """Whether state's matcher is built (building it if its grammar has compiled, waiting at most
        timeout seconds; None: until it has). Raises GrammarError when its grammar does not compile or its
        output so far does not follow it."""
        pending = state.extra.get("grammar")
        if not isinstance(pending, _Pending):
            return True
        if timeout is not None and timeout <= 0 and not pending.future.done():
            return False
        try:
            start = pending.future.result(timeout)
        except TimeoutError:
            return False
        matcher = start.deep_copy()
        if pending.output_ids and not matcher.consume_tokens(pending.output_ids):
            raise GrammarError(f"the output so far does not follow the grammar: {matcher.get_error()}")
        state.extra["grammar"] = matcher
        return True

    def prepare(self, states: list[SequenceState]) -> None:
        """Starts filling the masks of these states (a step's sampled grammar sequences, in batch order)
        while the forward runs; apply takes the result."""
        members = [s for s in states if self in s.processors and not self.idle(s)]
        if members:
            matchers = [self._matcher(s) for s in members]  # built here, on the step's thread
            self._prepared = (tuple(map(id, members)), self._fill_thread.submit(self._fill, matchers))

    def _fill(self, matchers: list) -> np.ndarray:
        words = (self.compiler.vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(matchers) or self._bitmask.shape[1] != words:
            self._bitmask = np.zeros((max(8, 2 * len(matchers)), words), dtype=np.int32)
        bitmask = self._bitmask[: len(matchers)]
        # One call fills every row on llguidance's threads, without the GIL.
        start = time.perf_counter()
        rows = [(m, i) for i, m in enumerate(matchers)]
        self.compiler.executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, words * 4, len(matchers))
        self.fill_seconds += time.perf_counter() - start
        return bitmask

    def apply(self, states, rows, logits):
        start = time.perf_counter()
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == tuple(map(id, states)):
            bitmask = prepared[1].result()
        else:  # a later depth of a speculative step, or no prepare: fill now
            if prepared is not None:
                prepared[1].result()  # never two fills at once: they share the buffer
            bitmask = self._fill([self._matcher(s) for s in states])
        # Bit j of word w allows token 32w + j (little-endian words): unpacked to one bool per token.
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
        banned = torch.from_numpy(allowed.view(np.bool_)).logical_not_().to(self.device)
        whole = len(states) == logits.shape[0]  # every row, in order (rows are ascending): in place
        sub = logits if whole else logits.index_select(0, rows)
        sub.masked_fill_(banned, float("-inf"))
        # Where earlier processors banned every token the grammar allows (bad_words, or min_tokens holding
        # back the EOS of a complete grammar), the grammar wins: its tokens, equally likely. Only rows with
        # another processor can be so.
        others = [i for i, s in enumerate(states) if len(s.processors) > 1]
        if others:
            index = torch.tensor(others, device=self.device)
            dead = torch.isneginf(sub.index_select(0, index)).all(dim=-1)
            if bool(dead.any()):
                fallback = torch.zeros_like(banned, dtype=sub.dtype).masked_fill_(banned, float("-inf"))
                revive = index[dead]
                sub.index_copy_(0, revive, fallback.index_select(0, revive))
        if not whole:
            logits.index_copy_(0, rows, sub)
        self.mask_seconds += time.perf_counter() - start

    def accept(self, states, tokens):
        for s, token in zip(states, tokens.tolist(), strict=True):
            matcher = self._matcher(s)
            if not matcher.consume_token(token):
                # Cannot happen under the mask; its error state then allows only EOS, which ends it.
                log.warning("grammar refused token %d: %s", token, matcher.get_error())

    def _matcher(self, state: SequenceState):
        if not self.ready(state, timeout=None):  # the scheduler waits for readiness: never here
            raise RuntimeError("grammar not compiled")
        return state.extra["grammar"]
