import asyncio

from common.client import AsyncGenerationClient, Completion, GenerationClient, build_request
from common.pb.tpserve.v1 import generation_pb2 as pb


def test_defaults_leave_sampling_unset_so_the_server_defaults_apply():
    req = build_request(text="hi")
    assert req.text == "hi" and list(req.token_ids) == []
    assert req.max_new_tokens == 16
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        assert not req.sampling.HasField(name)
    assert list(req.stop) == [] and list(req.stop_token_ids) == []
    assert not req.ignore_eos and req.top_logprobs == 0 and req.request_id == ""


def test_every_keyword_lands_in_its_field():
    req = build_request(
        token_ids=[1, 2, 3],
        max_new_tokens=7,
        temperature=0.0,
        top_p=0.5,
        top_k=0,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        seed=0,
        stop=("\n", "END"),
        stop_token_ids=[2],
        ignore_eos=True,
        top_logprobs=5,
        request_id="abc",
    )
    assert list(req.token_ids) == [1, 2, 3] and req.text == ""
    assert req.max_new_tokens == 7
    s = req.sampling
    # Explicit zeros must be sent as set: temperature 0 is greedy, not the default 1.
    assert s.HasField("temperature") and s.temperature == 0.0
    assert s.HasField("seed") and s.seed == 0
    assert s.HasField("top_k") and s.top_k == 0
    assert (s.top_p, s.min_p, s.repetition_penalty) == (0.5, 0.25, 1.5)
    assert (s.presence_penalty, s.frequency_penalty) == (-0.5, 0.25)
    assert list(req.stop) == ["\n", "END"] and list(req.stop_token_ids) == [2]
    assert req.ignore_eos and req.top_logprobs == 5 and req.request_id == "abc"


def test_invalid_values_are_sent_as_given_for_the_server_to_refuse():
    req = build_request(text="x", token_ids=[1], max_new_tokens=0, stop=None)
    assert req.text == "x" and list(req.token_ids) == [1] and req.max_new_tokens == 0


def test_completion_gathers_a_stream():
    c = Completion()
    c.add(pb.GenerateResponse(request_id="r", token_ids=[5, 6], text="ab"))
    c.add(pb.GenerateResponse(request_id="r", token_ids=[7], text=""))
    c.add(
        pb.GenerateResponse(
            request_id="r",
            token_ids=[8],
            text="c",
            finish_reason=pb.FINISH_REASON_STOP,
            usage=pb.Usage(prompt_tokens=3, completion_tokens=4),
        )
    )
    assert (c.request_id, c.text, c.token_ids) == ("r", "abc", [5, 6, 7, 8])
    assert c.finish_reason_name == "STOP" and c.usage.completion_tokens == 4


def test_clients_open_and_close_without_a_server():
    # Channels connect lazily, so building and closing one needs nothing listening.
    with GenerationClient("127.0.0.1:1", timeout=1.0) as client:
        assert client.timeout == 1.0

    async def main():
        async with AsyncGenerationClient("127.0.0.1:1") as client:
            assert client.timeout is None

    asyncio.run(main())
