"""A GGUF file served directly (`--model tiny.gguf`): the tiny Llama written with the gguf package's
writer and quantizers (tests/gguf_files.py: q, v, gate, up Q4_0, k and o Q4_1, kept 4-bit; down Q8_0 and
the F16 LM head dequantized at load), at --tp 2 (column- and row-parallel slices of the 4-bit rows and
groups). Greedy tokens must equal transformers' on the file's weights in float64: gguf's own dequantization of
each tensor saved as an HF checkpoint (transformers' GGUF loading keeps the weights packed and computes
in float32, 30 s for the prompts here on a shared CPU; its logits on one prompt are checked to equal
that checkpoint's). A text prompt is tokenized with the file's own tokenizer, as transformers reads it.

The same for the int8-kept types (a wider random Llama, K a multiple of Q6_K's 256): Q8_0, Q5_0 and Q6_K kept
int8 (our kernel's group layout, else PackedInt8Groups), qkv_proj mixing all three (group 16), down_proj Q6_K
split by rows of groups at --tp 2, an LM head Q8_0, and a Q8_0 embedding kept int8 (each rank its rows).
"""

from __future__ import annotations

import grpc
import pytest

from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.conftest import launch
from tests.gguf_files import INT8_TYPES, write_tiny_gguf, write_wide_llama
from tests.reference import GREEDY, assert_matches_reference, generate, hf_greedy

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def gguf_file(tiny_model, tmp_path_factory, monkeypatch_module):
    tmp = tmp_path_factory.mktemp("gguf")
    monkeypatch_module.setenv("TPSERVE_CACHE", str(tmp / "cache"))  # the launched processes inherit it
    return write_tiny_gguf(tiny_model, tmp / "tiny.gguf", reference_dir=tmp / "reference")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def int8_gguf_file(tiny_model, tmp_path_factory, monkeypatch_module):
    tmp = tmp_path_factory.mktemp("gguf_int8")
    monkeypatch_module.setenv("TPSERVE_CACHE", str(tmp / "cache"))
    wide = write_wide_llama(tiny_model, tmp / "wide")
    return write_tiny_gguf(wide, tmp / "wide.gguf", INT8_TYPES, reference_dir=tmp / "reference")


def test_gguf_file_served_at_tp2_equals_transformers_on_the_same_file(gguf_file):
    _served_equals_transformers(gguf_file)


def test_gguf_int8_kept_types_served_at_tp2_equal_transformers(int8_gguf_file):
    _served_equals_transformers(int8_gguf_file)


def _served_equals_transformers(gguf_file):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference_dir = gguf_file.parent / "reference"
    reference = hf_greedy(reference_dir)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ids = tok(TEXT).input_ids
    model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float64)
    text_ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    from_file = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    with torch.no_grad():
        logits = from_file(torch.tensor([ids])).logits.double()
        torch.testing.assert_close(logits, model(torch.tensor([ids])).logits, atol=1e-3, rtol=1e-4)
    with (
        launch(gguf_file, "--dtype", "float64", "--tp", "2") as (target, info),
        grpc.insecure_channel(target) as ch,
    ):
        stub = generation_pb2_grpc.GenerationStub(ch)
        assert_matches_reference(stub, reference)
        tokens, _, _, last = generate(stub, text=TEXT, max_new_tokens=8, ignore_eos=True, sampling=GREEDY)
        assert last.usage.prompt_tokens == len(ids)
        assert tokens == text_ref[0, len(ids) :].tolist()
