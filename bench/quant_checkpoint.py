"""Quantized copies of a real checkpoint for issue 29's comparison against vLLM's CPU build on the same
quantized weights. From a transformers Llama directory (default models/smollm2) it writes, under OUT,
one directory per format, named SRC-FORMAT, each with the source's tokenizer files:

  w8a8   compressed-tensors `int-quantized` W8A8: int8 weights, a scale per output channel (symmetric),
         input activations int8 per token, dynamic; written by compressed-tensors' own scheme and
         ModelCompressor as llmcompressor's W8A8 preset writes it (tests/quant_checkpoints.py compress)
  awq    AWQ `version: gemm`, 4 bits with zero points, group G (quant/awq.py pack_awq)
  gptq   GPTQ v1, 4 bits symmetric (`sym`, AutoGPTQ's default; vLLM's CPU build refuses sym false),
         group G, desc_act false (quant/gptq.py pack_gptq)
  w4a16  compressed-tensors `pack-quantized` W4A16, symmetric, group G

The LM head (tied to the embedding in SmolLM2), the embedding and the norms keep the source's dtype
(SmolLM2's is bfloat16). Data-free:
each weight is rounded to nearest with min-max scales (tests/quant_checkpoints.py minmax_int4 and
_calibrate_weight): no calibration set, no AWQ scale search, no GPTQ error feedback. So the layout,
configs and kernels are those of real checkpoints of these formats (what a speed comparison needs),
while the quality is a naive quantizer's (a lower bound on what AWQ or GPTQ would give).

G defaults to 64, not 128: SmolLM2's hidden size 576 is 4.5 groups of 128, and one group size must
divide every layer's input features (576 and 1536) in all these formats.

    python -m bench.quant_checkpoint --formats w8a8 awq --out /work/qckpt
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from tests.quant_checkpoints import compress, write_int4

FORMATS = ("w8a8", "awq", "gptq", "w4a16")


def build(src: Path, fmt: str, out: Path, group: int) -> Path:
    """Writes src's `fmt` copy to out (replacing it) and returns out."""
    shutil.rmtree(out, ignore_errors=True)
    if fmt in ("awq", "gptq"):
        write_int4(src, out, fmt, group, symmetric=fmt == "gptq")
    else:
        compress(src, fmt, out, dtype="auto", group_size=group)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, default=Path("models/smollm2"), help="the source checkpoint")
    p.add_argument("--out", type=Path, default=Path("/work/qckpt"), help="parent of the outputs")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=["w8a8", "awq"])
    p.add_argument("--group", type=int, default=64, help="group size of the 4-bit formats")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for fmt in a.formats:
        t0 = time.perf_counter()
        out = build(a.model, fmt, a.out / f"{a.model.name}-{fmt}", a.group)
        size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
        print(f"{out}: {size:.1f} MiB of weights, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
