"""A draft model for speculative decoding cut from a checkpoint: its first N decoder layers, with its
embeddings, final norm and LM head, written as a checkpoint of the same family (and tokenizer).

    python -m shard_worker.model.draft_builder --model DIR --num-layers N --out DIR

The draft shares the target's vocabulary by construction, and its first layers are the target's own,
so the two agree more often than two unrelated models would (the early-exit idea): the tests build one
from the tiny model, the benchmark from SmolLM2. Tensors are copied as stored; nothing is trained.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from shard_worker.model.loader import checkpoint_files

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Files of a checkpoint directory that are not weights: copied unchanged (tokenizer, chat template).
_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_draft(model_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """Writes the draft checkpoint to out_dir; returns it. ValueError when the model has too few layers."""
    src, out = Path(model_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers < total:
        raise ValueError(f"--num-layers must be in [1, {total}) for {src}, got {num_layers}")
    config["num_hidden_layers"] = num_layers
    for per_layer in ("layer_types",):  # lists with an entry per layer go with their layers
        if isinstance(config.get(per_layer), list):
            config[per_layer] = config[per_layer][:num_layers]
    tensors = {}
    for file in checkpoint_files(src):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                layer = _LAYER.match(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in [*_COPIED, *(p.name for p in src.glob("*.jinja"))]:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the target's checkpoint directory")
    parser.add_argument("--num-layers", type=int, required=True, help="decoder layers the draft keeps")
    parser.add_argument("--out", required=True, help="directory to write the draft to")
    args = parser.parse_args(argv)
    out = build_draft(args.model, args.out, args.num_layers)
    print(f"wrote a {args.num_layers}-layer draft of {args.model} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
