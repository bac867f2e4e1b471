"""Grammar libraries for structured outputs, measured side by side on one tokenizer: xgrammar and llguidance.

    python bench/grammar_libs.py [--model models/smollm2] [--batch 64] [--steps 30] [--threads 2]

Not part of tpserve's dependencies yet: it runs in a scratch venv that has both libraries, e.g.
    python3.11 -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install torch==2.13.0 xgrammar llguidance transformers
    /tmp/gvenv/bin/python bench/grammar_libs.py

For each library it reports, in milliseconds:
- compile: a grammar from nothing (caches off) for a JSON schema (an object with a string, a bounded integer,
  an enum and a nested array of objects), JSON mode (any object), a regular expression and a choice, after
  the one-off tokenizer preparation (also timed).
- the per-step mask work at batch `--batch`: the sequences are spread over the four grammars and walked a
  different number of tokens in, so they sit in different states; each step fills the token bitmask of every
  sequence ([batch, ceil(vocab / 32)] int32, the libraries' batch call on `--threads` threads), applies it to
  a [batch, vocab] float32 logits tensor (timed once for both: the kernel is shared), takes the greedy argmax
  and advances every matcher by its token (the libraries' batch calls for the mask and the advance)
  (a finished matcher is reset before the next step, so the batch stays full).
- rollback of 4 tokens (speculative decoding's rejected drafts) and rebuilding a matcher from 256 tokens of
  output (what a preempted or resumed sequence needs), per sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
        "climate": {"enum": ["dry", "wet", "mild"]},
        "districts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "area_km2": {"type": "number"}},
                "required": ["name", "area_km2"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["city", "population", "climate", "districts"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,10} [0-9]{1,3}(\.[0-9]{1,2})? (km|mi)"
CHOICE = ["Paris", "London", "Tokyo", "New York", "Buenos Aires"]
# A choice is the alternation of its strings (these need no escaping): how vLLM turns guided_choice into a
# grammar.
CHOICE_REGEX = "(" + "|".join(CHOICE) + ")"


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def spread(seconds: list[float]) -> dict:
    """Median and minimum in ms: on a shared machine the minimum is the cost, the median what load adds."""
    return {"median": ms(statistics.median(seconds)), "min": ms(min(seconds))}


def timed(fn, repeat: int = 1):
    """(median seconds, last result) of fn() over `repeat` calls."""
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab_size: int, threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.prepare_s, self.info = timed(
            lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
        )
        self.threads = threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compilers(self):
        # cache_enabled=False: every compile below is a cold one, as for a schema seen the first time.
        c = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        return {
            "json_schema": lambda: c.compile_json_schema(json.dumps(SCHEMA)),
            "json_object": lambda: c.compile_json_schema('{"type": "object"}'),
            "regex": lambda: c.compile_regex(REGEX),
            "choice": lambda: c.compile_regex(CHOICE_REGEX),
        }

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=8)

    def allocate(self, batch: int, vocab: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, vocab)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def accept_batch(self, matchers, tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def finished(self, m) -> bool:
        return m.is_terminated()

    def reset(self, m) -> None:
        m.reset()

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab_size: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.prepare_s, self.tok = timed(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size))
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compilers(self):
        M = self.llg.LLMatcher
        # LLMatcher builds its lexer and parser lazily: the first mask is part of the cost of a new grammar,
        # so "compile" here is construction plus the first mask (what a request waits for either way).
        bitmask = self.lt.allocate_token_bitmask(1, self.tok.vocab_size)

        def build(grammar: str):
            m = M(self.tok, grammar, log_level=0)
            assert not m.is_error(), m.get_error()
            self.lt.fill_next_token_bitmask(m, bitmask, 0)
            return grammar

        return {
            "json_schema": lambda: build(M.grammar_from_json_schema(json.dumps(SCHEMA))),
            "json_object": lambda: build(M.grammar_from_json_schema('{"type": "object"}')),
            "regex": lambda: build(M.grammar_from_regex(REGEX)),
            "choice": lambda: build(M.grammar_from_regex(CHOICE_REGEX)),
        }

    def matcher(self, grammar: str):
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def allocate(self, batch: int, vocab: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(batch, vocab)

    def fill(self, matchers, bitmask) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def accept_batch(self, matchers, tokens: list[int]) -> list[bool]:
        return self.lt.consume_token_par(self.executor, list(zip(matchers, tokens, strict=True)))

    def finished(self, m) -> bool:
        return m.is_stopped() or m.is_error()

    def reset(self, m) -> None:
        m.reset()

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


def apply_eager(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Bit j of word w allows token 32 * w + j (both libraries' layout): -inf where it is 0. Plain torch, so
    it runs wherever the logits are (llguidance.torch's own is this, torch.compile'd)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def apply_kernels() -> dict:
    """The ways to apply a bitmask that this host has: xgrammar's CPU kernel when installed, eager torch."""
    kernels = {"torch_eager": apply_eager}
    try:
        import xgrammar

        kernels["xgrammar_cpu"] = lambda logits, bitmask: xgrammar.apply_token_bitmask_inplace(
            logits, bitmask
        )
    except ImportError:
        pass
    return kernels


def walk(lib, m, steps: int, vocab: int, generator: torch.Generator) -> list[int]:
    """Advances matcher m by up to `steps` tokens, each drawn at random among those the grammar allows, so
    sequences of one grammar end in different states. Returns the tokens taken."""
    bitmask = lib.allocate(1, vocab)
    taken = []
    for _ in range(steps):
        if lib.finished(m):
            break
        lib.fill([m], bitmask)
        logits = torch.randn(1, vocab, generator=generator)
        apply_eager(logits, bitmask)
        token = int(logits.argmax())
        assert lib.accept(m, token), f"{lib.name}: an allowed token was refused"
        taken.append(token)
    return taken


def measure(lib, vocab: int, batch: int, steps: int) -> dict:
    out = {"tokenizer_prepare_ms": ms(lib.prepare_s), "compile_ms": {}}
    grammars = {}
    for kind, compile_fn in lib.compilers().items():
        compile_fn()  # warm the code paths once; caches are off, so the timed calls still compile afresh
        seconds, grammars[kind] = timed(compile_fn, repeat=5)
        out["compile_ms"][kind] = ms(seconds)

    kinds = list(grammars)
    generator = torch.Generator().manual_seed(0)
    matchers, histories = [], []
    for i in range(batch):
        m = lib.matcher(grammars[kinds[i % len(kinds)]])
        histories.append(walk(lib, m, (i * 7) % 23, vocab, generator))
        matchers.append(m)

    bitmask = lib.allocate(batch, vocab)
    fill_t, accept_t = [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=generator)
        for m in matchers:
            if lib.finished(m):  # a finished sequence leaves the batch and a new one takes its row
                lib.reset(m)
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        t1 = time.perf_counter()
        apply_eager(logits, bitmask)  # not timed here: the kernel is the libraries' common part (below)
        tokens = logits.argmax(dim=-1).tolist()  # not timed here either (argmax_ms, below)
        t2 = time.perf_counter()
        accepted = lib.accept_batch(matchers, tokens)  # the libraries' batch call, as a server would
        assert all(accepted), f"{lib.name}: a greedy token under the mask was refused"
        t3 = time.perf_counter()
        fill_t.append(t1 - t0)
        accept_t.append(t3 - t2)
    out[f"step_ms_batch{batch}"] = {
        "fill_bitmask": spread(fill_t),
        "advance_matchers": spread(accept_t),
    }

    # Speculative decoding: take 4 draft tokens, then roll them back (all rejected). The probe walks the
    # same seeded path 4 tokens further, so its last 4 tokens are valid drafts for m.
    m = lib.matcher(grammars["json_schema"])
    walk(lib, m, 10, vocab, torch.Generator().manual_seed(1))
    probe = lib.matcher(grammars["json_schema"])
    drafts = walk(lib, probe, 14, vocab, torch.Generator().manual_seed(1))[10:]

    def draft_and_reject():
        for t in drafts:
            assert lib.accept(m, t)
        lib.rollback(m, len(drafts))

    seconds, _ = timed(draft_and_reject, repeat=20)
    out[f"accept_and_rollback_{len(drafts)}_tokens_ms"] = ms(seconds)

    # Resume after preemption: a fresh matcher fed the output so far (JSON mode, a long walk).
    long = lib.matcher(grammars["json_object"])
    history = walk(lib, long, 256, vocab, torch.Generator().manual_seed(2))

    def rebuild():
        fresh = lib.matcher(grammars["json_object"])
        for t in history:
            lib.accept(fresh, t)
        return fresh

    seconds, _ = timed(rebuild, repeat=5)
    out[f"rebuild_from_{len(history)}_tokens_ms"] = ms(seconds)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "models" / "smollm2"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=["xgrammar", "llguidance"])
    a = p.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    torch.set_num_threads(a.threads)
    hf = AutoTokenizer.from_pretrained(a.model)
    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    results = {"model": a.model, "vocab_size": vocab, "batch": a.batch, "threads": a.threads}
    # Applying the mask and the argmax after it are the same work whichever library filled the mask.
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (a.batch, (vocab + 31) // 32), dtype=torch.int32, generator=generator
    )
    logits = torch.randn(a.batch, vocab, generator=generator)
    results["apply_bitmask_ms"] = {
        name: ms(timed(lambda k=kernel: k(logits.clone(), bitmask), repeat=a.steps)[0])
        for name, kernel in apply_kernels().items()
    }
    results["clone_logits_ms"] = ms(timed(lambda: logits.clone(), repeat=a.steps)[0])  # inside the above
    results["argmax_ms"] = ms(timed(lambda: logits.argmax(dim=-1).tolist(), repeat=a.steps)[0])
    for cls in (XGrammar, LLGuidance):
        if a.only in (None, cls.name):
            results[cls.name] = measure(cls(hf, vocab, a.threads), vocab, a.batch, a.steps)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
