"""Images through the chat path: the encoder cache's effect on TTFT, and whether preparing a large image
holds up other requests.

The model is a Gemma 3-shaped random Gemma3ForConditionalGeneration (tests/vision_models.py): Gemma 3's
image side (896 x 896 pixels, 14-pixel patches: 4,096 patches pooled to 256 soft tokens) with a SigLIP
tower of --vision-hidden and --vision-layers (the real one: 1152 and 27, minutes an image on a CPU), and a
small text decoder. Prefix caching stays off, so that a repeated request recomputes its prompt and only
the encoder cache differs.

1. Cold against warm, at concurrency 1 to 16: N chat requests at once, each with a picture the workers
   have not seen (cold: the encoder runs), then the same N again (warm: taken from the encoder cache by
   the picture's hash). TTFT p50 of each, and warm / cold (the issue's target: at most 0.5).
2. A text-only chat request's TTFT alone, and sent while the router prepares a 4096 x 4096 picture of
   another request (decode, hash, the processor's resize and normalisation, off the event loop): sent
   --offset-ms after the picture's request, which is timed too (the window the router spends on it).
   Target: at most 2x alone.

    .venv/bin/python -m bench.vision [--levels 1,4,16] [--vision-hidden 384 --vision-layers 2]

Ratios within one run are what to read: on a shared CPU the absolute figures move with the neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from common.launcher import running_stack
from common.pb.tpserve.v1 import generation_pb2 as pb
from common.pb.tpserve.v1 import generation_pb2_grpc
from tests.vision_models import build_gemma3_vl, picture, png

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


def big_picture(seed: int, side: int = 4096) -> bytes:
    """A side x side JPEG (smooth, so that it stays under --max-image-bytes) of seeded noise on gradients."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = (np.arange(side) * 200 // side).astype(np.uint8)
    rgb = np.empty((side, side, 3), dtype=np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = ramp[None, :], ramp[:, None], 100
    rgb += rng.integers(0, 24, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, "JPEG", quality=85)
    return out.getvalue()


async def ttft(stub, text: str, image: bytes | None = None) -> float:
    """Seconds to the first token of a chat request (one user turn: text, then the image if any)."""
    parts = [pb.ContentPart(text=text)] + ([pb.ContentPart(image=pb.Image(data=image))] if image else [])
    req = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", parts=parts)],
        max_new_tokens=2,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0),
    )
    start = time.perf_counter()
    async for resp in stub.Generate(req, timeout=600):
        if resp.token_ids:
            first = time.perf_counter() - start
            break
    return first


async def cold_warm(target: str, levels: list[int], seed: int) -> list[tuple[int, float, float]]:
    rows = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await ttft(stub, "warm up", png(picture(seed + 999_999, (896, 896))))  # the stack's first steps
        for level in levels:
            images = [png(picture(seed + 1000 * level + i, (896, 896))) for i in range(level)]
            cold = await asyncio.gather(*(ttft(stub, "Describe this.", im) for im in images))
            warm = await asyncio.gather(*(ttft(stub, "Describe this.", im) for im in images))
            rows.append((level, statistics.median(cold), statistics.median(warm)))
            print(
                f"concurrency {level}: cold {rows[-1][1] * 1000:.0f} ms, warm {rows[-1][2] * 1000:.0f} ms",
                flush=True,
            )
    return rows


async def beside_big_image(
    target: str, trials: int, offset_s: float
) -> tuple[list[float], list[float], list[float]]:
    """(text TTFTs alone, text TTFTs beside a 4096 x 4096 picture's preparation, the picture's TTFTs)."""
    alone, beside, big = [], [], []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await ttft(stub, "warm up")
        for trial in range(trials):
            alone.append(await ttft(stub, "Just words, no picture."))
            image = big_picture(trial)
            picture_task = asyncio.ensure_future(ttft(stub, "Describe this.", image))
            await asyncio.sleep(offset_s)
            beside.append(await ttft(stub, "Just words, no picture."))
            big.append(await picture_task)
            print(
                f"trial {trial}: alone {alone[-1] * 1000:.0f} ms, beside {beside[-1] * 1000:.0f} ms, "
                f"the 4096 x 4096 picture's TTFT {big[-1] * 1000:.0f} ms",
                flush=True,
            )
    return alone, beside, big


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="1,2,4,8,16")
    p.add_argument("--vision-hidden", type=int, default=384)
    p.add_argument("--vision-layers", type=int, default=2)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument(
        "--offset-ms", type=float, default=50.0, help="the text request's delay after the picture's"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_gemma3_vl(
            Path(tmp) / "gemma3-shaped",
            TINY,
            image_size=896,
            patch_size=14,
            tokens_per_image=256,
            hidden=256,
            layers=4,
            vision_hidden=args.vision_hidden,
            vision_layers=args.vision_layers,
        )
        flags = ("--dtype", "float32", "--max-num-batched-tokens", "8192", "--max-num-seqs", "32")
        with running_stack(model, *flags) as (info, _):
            levels = [int(x) for x in args.levels.split(",")]
            rows = asyncio.run(cold_warm(info["target"], levels, args.seed))
            alone, beside, big = asyncio.run(
                beside_big_image(info["target"], args.trials, args.offset_ms / 1000)
            )
    print("\n| concurrency | TTFT p50 cold (ms) | TTFT p50 warm (ms) | warm / cold |")
    print("|---|---|---|---|")
    for level, cold, warm in rows:
        print(f"| {level} | {cold * 1000:.0f} | {warm * 1000:.0f} | {warm / cold:.2f} |")
    a, b = statistics.median(alone), statistics.median(beside)
    print(
        f"\ntext-only TTFT p50: alone {a * 1000:.0f} ms, beside a 4096 x 4096 picture's preparation "
        f"{b * 1000:.0f} ms ({b / a:.2f}x); the picture's own TTFT p50 {statistics.median(big) * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
