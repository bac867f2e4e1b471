import math

import pytest

from common.pb.tpserve.v1 import generation_pb2
from common.sampling import SamplingConfig
from router.validation import (
    Limits,
    ValidationError,
    check_prompt_tokens,
    check_request_fields,
    validate_request,
)

LIMITS = Limits(vocab_size=1000, max_model_len=128)


def fake_tokenize(text: str) -> list[int]:
    # One token per character keeps prompt lengths obvious in the length tests.
    return [ord(c) % 1000 for c in text]


def request(**kwargs) -> generation_pb2.GenerateRequest:
    sampling = kwargs.pop("sampling", {})
    kwargs.setdefault("max_new_tokens", 8)
    if "text" not in kwargs and "token_ids" not in kwargs:
        kwargs["token_ids"] = [1, 2, 3]
    return generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(**sampling), **kwargs)


def rejected(req, limits=LIMITS) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        validate_request(req, limits, tokenize=fake_tokenize, render_chat=lambda m: [1])
    return info.value


def test_valid_token_ids_request_resolves_defaults():
    v = validate_request(request(token_ids=[5, 6, 999], max_new_tokens=10), LIMITS)
    assert v.prompt_token_ids == (5, 6, 999)
    assert v.prompt_text is None
    assert v.max_new_tokens == 10
    assert v.sampling == SamplingConfig()
    assert v.sampling.temperature == 1.0 and v.sampling.top_p == 1.0 and v.sampling.top_k == 0
    assert v.sampling.min_p == 0.0 and v.sampling.repetition_penalty == 1.0 and v.sampling.seed is None
    assert v.stop == () and v.stop_token_ids == () and not v.ignore_eos and v.top_logprobs == 0
    assert v.request_id == ""


def test_valid_text_request_is_tokenized_and_keeps_everything_asked_for():
    req = request(
        request_id="r1",
        text="hello",
        max_new_tokens=5,
        sampling=dict(temperature=0.0, top_k=40, top_p=0.5, min_p=0.1, repetition_penalty=1.2, seed=7),
        stop=["\n\n", "END"],
        stop_token_ids=[2],
        ignore_eos=True,
        top_logprobs=20,
    )
    v = validate_request(req, LIMITS, tokenize=fake_tokenize)
    assert v.prompt_token_ids == tuple(fake_tokenize("hello"))
    assert v.prompt_text == "hello"
    assert v.request_id == "r1"
    assert v.sampling.greedy and v.sampling.top_k == 40 and v.sampling.seed == 7
    assert v.sampling.top_p == pytest.approx(0.5) and v.sampling.repetition_penalty == pytest.approx(1.2)
    assert v.stop == ("\n\n", "END") and v.stop_token_ids == (2,) and v.ignore_eos and v.top_logprobs == 20


def test_prompt_exactly_fills_max_model_len():
    v = validate_request(request(token_ids=[1] * 120, max_new_tokens=8), LIMITS)
    assert len(v.prompt_token_ids) + v.max_new_tokens == LIMITS.max_model_len


def test_text_prompt_without_tokenizer_is_a_programming_error():
    with pytest.raises(TypeError):
        validate_request(request(text="hi"), LIMITS)


@pytest.mark.parametrize(
    "req, field, words",
    [
        (generation_pb2.GenerateRequest(max_new_tokens=4), "text", ["empty"]),
        (request(text="", token_ids=[]), "text", ["empty"]),
        (request(text="hi", token_ids=[1]), "token_ids", ["text", "token_ids"]),
        (request(token_ids=[1, 1000, 2]), "token_ids[1]", ["1000", "vocab_size 1000"]),
        (request(max_new_tokens=0), "max_new_tokens", ["at least 1"]),
        (request(max_new_tokens=128), "max_new_tokens", ["max_model_len 128"]),
        (request(token_ids=[1] * 121, max_new_tokens=8), "max_new_tokens", ["121", "8", "max_model_len 128"]),
        (request(text="x" * 100, max_new_tokens=29), "max_new_tokens", ["100", "29", "max_model_len 128"]),
        (request(token_ids=[1] * 128, max_new_tokens=1), "token_ids", ["128", "127"]),
        (request(sampling=dict(temperature=-0.5)), "sampling.temperature", ["[0, 2]", "-0.5"]),
        (request(sampling=dict(temperature=3)), "sampling.temperature", ["[0, 2]", "got 3"]),
        (request(sampling=dict(temperature=math.nan)), "sampling.temperature", ["finite"]),
        (request(sampling=dict(temperature=math.inf)), "sampling.temperature", ["finite"]),
        (request(sampling=dict(top_p=0.0)), "sampling.top_p", ["(0, 1]"]),
        (request(sampling=dict(top_p=1.5)), "sampling.top_p", ["(0, 1]"]),
        (request(sampling=dict(top_p=-0.1)), "sampling.top_p", ["(0, 1]"]),
        (request(sampling=dict(top_p=math.nan)), "sampling.top_p", ["finite"]),
        (request(sampling=dict(top_k=-1)), "sampling.top_k", [">= 0"]),
        (request(sampling=dict(min_p=-0.1)), "sampling.min_p", ["[0, 1]"]),
        (request(sampling=dict(min_p=1.1)), "sampling.min_p", ["[0, 1]"]),
        (request(sampling=dict(repetition_penalty=0.0)), "sampling.repetition_penalty", ["> 0"]),
        (request(sampling=dict(repetition_penalty=-1.0)), "sampling.repetition_penalty", ["> 0"]),
        (request(sampling=dict(presence_penalty=math.inf)), "sampling.presence_penalty", ["finite"]),
        (request(sampling=dict(frequency_penalty=math.nan)), "sampling.frequency_penalty", ["finite"]),
        (request(stop=[str(i) for i in range(17)]), "stop", ["17", "16"]),
        (request(stop=["ok", ""]), "stop[1]", ["empty"]),
        (request(stop=["x" * 257]), "stop[0]", ["257", "256"]),
        (request(stop_token_ids=[3, 5000]), "stop_token_ids[1]", ["5000", "vocab_size 1000"]),
        (request(top_logprobs=21), "top_logprobs", ["21", "20"]),
        (request(request_id="r" * 300), "request_id", ["300", "256"]),
    ],
)
def test_bad_request_names_field_and_limit(req, field, words):
    err = rejected(req)
    assert err.field == field
    assert field.split("[")[0] in str(err)
    for word in words:
        assert word in str(err)


def test_boundaries_that_are_allowed():
    ok = [
        request(sampling=dict(top_p=1.0, min_p=0.0, temperature=0.0, top_k=0)),
        request(sampling=dict(min_p=1.0, repetition_penalty=1e-3, presence_penalty=-2.0)),
        request(stop=[str(i) for i in range(16)], top_logprobs=20),
        request(stop_token_ids=[999]),
        request(text=" "),
    ]
    for req in ok:
        validate_request(req, LIMITS, tokenize=fake_tokenize)


def test_two_stages_split_the_work():
    # Stage one needs no tokenizer and must reject a bad field before any tokenizing is paid for.
    with pytest.raises(ValidationError) as info:
        check_request_fields(request(text="x" * 1000, sampling=dict(top_p=2.0)), LIMITS)
    assert info.value.field == "sampling.top_p"
    sampling = check_request_fields(request(text="hello", sampling=dict(top_k=3)), LIMITS)
    assert sampling.top_k == 3
    check_prompt_tokens([1] * 100, 28, LIMITS)
    with pytest.raises(ValidationError) as info:
        check_prompt_tokens([1] * 100, 29, LIMITS)
    assert info.value.field == "max_new_tokens"
    with pytest.raises(ValidationError) as info:
        check_prompt_tokens([], 1, LIMITS, prompt_field="text")
    assert info.value.field == "text"


def test_text_length_is_bounded_before_tokenizing():
    limits = Limits(vocab_size=1000, max_model_len=128, max_prompt_chars=50)
    calls = []

    def tokenize(text):
        calls.append(text)
        return fake_tokenize(text)

    with pytest.raises(ValidationError) as info:
        validate_request(request(text="x" * 51), limits, tokenize=tokenize)
    assert info.value.field == "text" and "50" in str(info.value)
    assert calls == []


def test_max_prompt_tokens_limit():
    limits = Limits(vocab_size=1000, max_model_len=128, max_prompt_tokens=10)
    validate_request(request(token_ids=[1] * 10), limits)
    err = rejected(request(text="x" * 11), limits)
    assert err.field == "text" and "11" in str(err) and "10" in str(err)


def test_tokenizer_ids_beyond_the_model_vocab_are_refused():
    with pytest.raises(ValidationError) as info:
        validate_request(request(text="abc"), LIMITS, tokenize=lambda text: [1, 1500])
    assert info.value.field == "text" and "1500" in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(vocab_size=0, max_model_len=10),
        dict(vocab_size=10, max_model_len=1),
        dict(vocab_size=10, max_model_len=10, max_prompt_tokens=10),
        dict(vocab_size=10, max_model_len=10, max_stop_strings=-1),
    ],
)
def test_limits_reject_nonsense(kwargs):
    with pytest.raises(ValueError):
        Limits(**kwargs)


def test_unset_max_new_tokens_takes_the_default_lowered_to_fit():
    limits = Limits(vocab_size=1000, max_model_len=300, default_max_new_tokens=256)
    assert validate_request(generation_pb2.GenerateRequest(token_ids=[1] * 10), limits).max_new_tokens == 256
    # 100 prompt tokens leave room for 200.
    assert validate_request(generation_pb2.GenerateRequest(token_ids=[1] * 100), limits).max_new_tokens == 200
    capped = Limits(vocab_size=1000, max_model_len=300, max_new_tokens=50)
    assert validate_request(generation_pb2.GenerateRequest(token_ids=[1] * 10), capped).max_new_tokens == 50
    assert "at least 1" in str(rejected(generation_pb2.GenerateRequest(token_ids=[1], max_new_tokens=0)))


def test_chat_prompt_is_rendered_and_checked():
    def render(prompt):
        return [len(m["content"]) for m in prompt.messages]

    req = generation_pb2.GenerateRequest(
        messages=[generation_pb2.ChatMessage(role="user", content="hello")], max_new_tokens=4
    )
    assert validate_request(req, LIMITS, render_chat=render).prompt_token_ids == (5,)
    both = generation_pb2.GenerateRequest(text="x", messages=req.messages, max_new_tokens=4)
    assert rejected(both).field == "messages"
    bad_role = generation_pb2.GenerateRequest(
        messages=[generation_pb2.ChatMessage(role="robot", content="x")]
    )
    err = rejected(bad_role)
    assert err.field == "messages[0].role" and "robot" in str(err)


@pytest.mark.parametrize(
    "sampling, field, words",
    [
        (dict(presence_penalty=2.5), "sampling.presence_penalty", ["[-2.0, 2.0]"]),
        (dict(frequency_penalty=-3e38), "sampling.frequency_penalty", ["[-2.0, 2.0]"]),
        (dict(repetition_penalty=1e30), "sampling.repetition_penalty", ["at most 10.0"]),
    ],
)
def test_penalties_beyond_sane_ranges_are_refused(sampling, field, words):
    err = rejected(request(sampling=sampling))
    assert err.field == field and all(w in str(err) for w in words)


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 0.0])
def test_a_vanishing_temperature_is_greedy_and_travels_as_greedy(temperature):
    v = validate_request(request(sampling=dict(temperature=temperature)), LIMITS)
    assert v.sampling.temperature == 0.0 and v.sampling.greedy
    assert v.sampling.to_proto().temperature == 0.0


def test_operator_cap_on_max_new_tokens():
    limits = Limits(vocab_size=100, max_model_len=1000, max_new_tokens=10)
    with pytest.raises(ValidationError) as e:
        validate_request(generation_pb2.GenerateRequest(token_ids=[5], max_new_tokens=11), limits)
    assert e.value.field == "max_new_tokens" and "10" in str(e.value)
    assert validate_request(generation_pb2.GenerateRequest(token_ids=[5], max_new_tokens=10), limits)


def test_unset_sampling_fields_take_the_models_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.2, "top_p": 0.9}')
    defaults = SamplingConfig.model_defaults(tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.2, 0.9, 0)
    limits = Limits(vocab_size=1000, max_model_len=128, sampling_defaults=defaults)
    assert validate_request(request(), limits).sampling == defaults
    chosen = validate_request(request(sampling=dict(temperature=0.0)), limits).sampling
    assert chosen.temperature == 0.0 and chosen.top_p == 0.9  # the request's own wins, field by field
    assert SamplingConfig.model_defaults(tmp_path / "nowhere") == SamplingConfig()
