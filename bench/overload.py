"""Overload probe: N concurrent Generate streams over C channels, counted by the status each ends with.

    python -m bench.overload --target HOST:PORT -n 10000 -c 8      # against a running router
    python -m bench.overload --bare -n 10000 -c 8                   # against a bare grpc.aio server

--bare starts, in a child process, a grpc.aio server with no tpserve code that streams a few messages per
call, so what gRPC itself does under a burst can be told apart from what the router does. Every call
ends either with its tokens (OK) or with a status; the counts per status, and the first details string
seen for each, are printed as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections import Counter

import grpc

from common.pb.tpserve.v1 import generation_pb2, generation_pb2_grpc

BARE_METHOD = "/bare.Bare/Stream"


def _bare_server(port_queue, messages: int, options: list, maximum_concurrent_rpcs: int | None) -> None:
    async def stream(request: bytes, context):
        for _ in range(messages):
            yield b"x" * 16
            await asyncio.sleep(0.01)

    async def main():
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=maximum_concurrent_rpcs)
        handler = grpc.method_handlers_generic_handler(
            "bare.Bare", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


async def _one_bare(channel, timeout_s: float) -> tuple[str, str, float]:
    start = time.monotonic()
    call = channel.unary_stream(BARE_METHOD)(b"hi", timeout=timeout_s)
    try:
        async for _ in call:
            pass
        return "OK", "", time.monotonic() - start
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details() or "", time.monotonic() - start


async def _one_generate(stub, i: int, max_new_tokens: int, timeout_s: float) -> tuple[str, str, float]:
    start = time.monotonic()
    request = generation_pb2.GenerateRequest(
        token_ids=[5 + i % 50, 7, 9], max_new_tokens=max_new_tokens, ignore_eos=True
    )
    try:
        tokens = 0
        async for resp in stub.Generate(request, timeout=timeout_s):
            tokens += len(resp.token_ids)
        if tokens != max_new_tokens:
            return "SHORT", f"{tokens} tokens", time.monotonic() - start
        return "OK", "", time.monotonic() - start
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details() or "", time.monotonic() - start


async def burst(
    target: str, n: int, channels: int, bare: bool, max_new_tokens: int = 4, timeout_s: float = 300.0
) -> dict:
    """Starts n calls at once over `channels` channels; returns counts per status and a sample message
    and the median time to that status for each."""
    chans = [grpc.aio.insecure_channel(target) for _ in range(channels)]
    try:
        for c in chans:
            await c.channel_ready()
        if bare:
            calls = [_one_bare(chans[i % channels], timeout_s) for i in range(n)]
        else:
            stubs = [generation_pb2_grpc.GenerationStub(c) for c in chans]
            calls = [_one_generate(stubs[i % channels], i, max_new_tokens, timeout_s) for i in range(n)]
        start = time.monotonic()
        results = await asyncio.gather(*calls)
        wall = time.monotonic() - start
    finally:
        for c in chans:
            await c.close()
    counts = Counter(code for code, _, _ in results)
    sample, times = {}, {}
    for code, details, elapsed in results:
        sample.setdefault(code, details[:160])
        times.setdefault(code, []).append(elapsed)
    median = {code: round(sorted(t)[len(t) // 2], 3) for code, t in times.items()}
    return {
        "n": n,
        "channels": channels,
        "counts": dict(counts),
        "median_s": median,
        "sample": sample,
        "wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="a running router's HOST:PORT")
    p.add_argument("--bare", action="store_true", help="probe a bare grpc.aio server instead")
    p.add_argument(
        "--bare-option", action="append", default=[], help="NAME=INT: a channel arg of the bare server"
    )
    p.add_argument(
        "--bare-max-rpcs", type=int, default=None, help="the bare server's maximum_concurrent_rpcs"
    )
    p.add_argument("-n", type=int, nargs="+", default=[1000, 3000, 10000])
    p.add_argument("-c", "--channels", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=4)
    a = p.parse_args()
    proc = None
    target = a.target
    if a.bare:
        options = [(k, int(v)) for k, v in (o.split("=", 1) for o in a.bare_option)]
        ports = multiprocessing.Queue()
        proc = multiprocessing.Process(target=_bare_server, args=(ports, 8, options, a.bare_max_rpcs))
        proc.start()
        target = f"127.0.0.1:{ports.get(timeout=30)}"
    try:
        for n in a.n:
            print(json.dumps(asyncio.run(burst(target, n, a.channels, a.bare, a.max_new_tokens))), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.join()


if __name__ == "__main__":
    main()
