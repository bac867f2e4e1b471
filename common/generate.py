"""`tpserve generate`: stream one completion from a running server (a small gRPC client)."""

from __future__ import annotations

import argparse
import sys

from common import security
from common.sampling import SAMPLING_FIELDS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text (with --chat: the user's message)")
    p.add_argument("--target", default="127.0.0.1:50051", help="router HOST:PORT")
    p.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message in the model's chat template"
    )
    p.add_argument("--system", default=None, help="with --chat: a system message before it")
    p.add_argument("--max-new-tokens", type=int, default=None, help="(default: the server's, 256)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    security.add_client_arguments(p)


def main(a: argparse.Namespace) -> int:
    import grpc

    from common.client import GenerationClient

    sampling = {k: getattr(a, k) for k in SAMPLING_FIELDS if getattr(a, k) is not None}
    auth = security.client_from_args(a)
    try:
        with GenerationClient(
            a.target,
            timeout=a.timeout,
            credentials=auth.credentials(),
            metadata=auth.metadata,
            options=auth.options(),
        ) as client:
            if a.chat:
                system = [{"role": "system", "content": a.system}] if a.system else []
                prompt = dict(messages=[*system, {"role": "user", "content": a.prompt}])
            else:
                prompt = dict(text=a.prompt)
            for resp in client.generate(
                **prompt,
                max_new_tokens=a.max_new_tokens,
                stop=a.stop,
                ignore_eos=a.ignore_eos,
                **sampling,
            ):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    except grpc.RpcError as e:
        print(f"\ntpserve: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
