"""A small client for the public tpserve.v1.Generation API (CLI, tests, benchmark).

Keyword arguments mirror GenerateRequest; sampling fields are flattened (temperature=..., not
sampling=...) and left unset unless given, so the server's documented defaults apply.

    with GenerationClient("localhost:8000") as client:
        for resp in client.generate(text="Hello", max_new_tokens=20):
            print(resp.text, end="")
        print(client.complete(text="Hello", max_new_tokens=20, temperature=0).text)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from common.grpc_util import MAX_MESSAGE_BYTES
from common.pb.tpserve.v1 import generation_pb2, generation_pb2_grpc

# The same limit as the servers: a prompt sent as token ids of a long context is megabytes, past
# gRPC's 4 MiB receive default. Keepalive stays at gRPC's defaults: a public client may sit behind
# proxies that close connections which ping more often than they allow.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def build_request(
    *,
    text: str = "",
    token_ids: Sequence[int] = (),
    messages: Sequence[dict[str, str]] = (),
    max_new_tokens: int | None = 16,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    stop: Iterable[str] | None = None,
    stop_token_ids: Iterable[int] | None = None,
    ignore_eos: bool = False,
    top_logprobs: int = 0,
    request_id: str = "",
) -> generation_pb2.GenerateRequest:
    """Builds a GenerateRequest. messages: a conversation, [{"role": "user", "content": "..."}, ...].
    max_new_tokens None leaves it unset (the server's default). Nothing is checked here: the server
    validates, and tests rely on being able to send requests it must refuse."""
    values = dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        seed=seed,
    )
    sampling = generation_pb2.SamplingParams(**{k: v for k, v in values.items() if v is not None})
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        text=text,
        token_ids=list(token_ids),
        messages=[generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=list(stop or ()),
        stop_token_ids=list(stop_token_ids or ()),
        ignore_eos=ignore_eos,
        top_logprobs=top_logprobs,
    )


@dataclass
class Completion:
    """A whole generation, gathered from the stream."""

    request_id: str = ""
    text: str = ""
    reasoning: str = ""  # a reasoning parser's share of the output (GenerateResponse.reasoning_text)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generation_pb2.Logprobs] = field(default_factory=list)
    finish_reason: int = generation_pb2.FINISH_REASON_UNSPECIFIED
    usage: generation_pb2.Usage | None = None

    @property
    def finish_reason_name(self) -> str:
        """ "LENGTH", "EOS", "STOP" or "ABORTED"."""
        return generation_pb2.FinishReason.Name(self.finish_reason).removeprefix("FINISH_REASON_")

    def add(self, resp: generation_pb2.GenerateResponse) -> None:
        self.request_id = resp.request_id
        self.text += resp.text
        self.reasoning += resp.reasoning_text
        self.token_ids.extend(resp.token_ids)
        self.logprobs.extend(resp.logprobs)
        if resp.finish_reason:
            self.finish_reason = resp.finish_reason
            self.usage = resp.usage


def _open_channel(api, target: str, credentials, options):
    """A channel from `api` (grpc or grpc.aio): TLS when credentials are given, with our options."""
    options = [*CHANNEL_OPTIONS, *options]
    if credentials is None:
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, credentials, options=options)


class GenerationClient:
    """Blocking client. timeout is the deadline, in seconds, of each call (a whole stream for
    generate); None waits forever."""

    def __init__(
        self,
        target: str,
        timeout: float | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, object]] = (),  # more channel options (ssl_target_name_override)
    ):
        self.timeout = timeout
        self._metadata = tuple(metadata)
        self._channel = _open_channel(grpc, target, credentials, options)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, **kwargs) -> Iterator[generation_pb2.GenerateResponse]:
        """Streams the responses; keyword arguments as build_request. Raises grpc.RpcError."""
        call = self._stub.Generate(build_request(**kwargs), timeout=self.timeout, metadata=self._metadata)
        try:
            yield from call
        finally:
            # A caller that stops iterating early is done with the request: cancelling lets the
            # server free its KV blocks now rather than generate to the end.
            call.cancel()

    def complete(self, **kwargs) -> Completion:
        """Runs one generation to the end and returns it whole."""
        result = Completion()
        for resp in self.generate(**kwargs):
            result.add(resp)
        return result

    def model_info(self) -> generation_pb2.ModelInfo:
        return self._stub.GetModelInfo(
            generation_pb2.ModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
        )

    def stats(self) -> generation_pb2.Stats:
        return self._stub.GetStats(
            generation_pb2.StatsRequest(), timeout=self.timeout, metadata=self._metadata
        )


class AsyncGenerationClient:
    """asyncio client with the same methods as GenerationClient, to be awaited. Create it inside the
    event loop that uses it (grpc.aio channels belong to one loop)."""

    def __init__(
        self,
        target: str,
        timeout: float | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, object]] = (),  # more channel options (ssl_target_name_override)
    ):
        self.timeout = timeout
        self._metadata = tuple(metadata)
        self._channel = _open_channel(grpc.aio, target, credentials, options)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, **kwargs) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Streams the responses; keyword arguments as build_request. Raises grpc.RpcError.

        To stop early, close the iterator (contextlib.aclosing) so the call is cancelled at once and
        not when the generator is collected.
        """
        call = self._stub.Generate(build_request(**kwargs), timeout=self.timeout, metadata=self._metadata)
        try:
            async for resp in call:
                yield resp
        finally:
            call.cancel()  # as in GenerationClient.generate: free the server's KV blocks at once

    async def complete(self, **kwargs) -> Completion:
        result = Completion()
        async for resp in self.generate(**kwargs):
            result.add(resp)
        return result

    async def model_info(self) -> generation_pb2.ModelInfo:
        return await self._stub.GetModelInfo(
            generation_pb2.ModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
        )

    async def stats(self) -> generation_pb2.Stats:
        return await self._stub.GetStats(
            generation_pb2.StatsRequest(), timeout=self.timeout, metadata=self._metadata
        )
