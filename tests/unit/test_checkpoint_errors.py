"""A checkpoint that cannot be read is a ValueError naming the file (the CLI's one line, exit 2)."""

import pytest

from shard_worker.model.config import ModelConfig
from shard_worker.model.loader import INDEX_FILE, checkpoint_files


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "no config.json there"),
        ("{", "config.json: not valid JSON"),
        (b"\xff\xfe", "config.json: not valid JSON"),
        ("[1]", "config.json: not a JSON object"),
    ],
)
def test_config_json(tmp_path, text, message):
    if isinstance(text, bytes):
        (tmp_path / "config.json").write_bytes(text)
    elif text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "index, message",
    [
        ("{", f"{INDEX_FILE}: not valid JSON"),
        ('{"metadata": {}}', f"{INDEX_FILE}: no weight_map in it"),
        ('{"weight_map": {"a": "model-1.safetensors"}}', "names model-1.safetensors, which is not in"),
    ],
)
def test_index(tmp_path, index, message):
    (tmp_path / INDEX_FILE).write_text(index)
    with pytest.raises(ValueError, match=message):
        checkpoint_files(tmp_path)


def test_no_weights(tmp_path):
    with pytest.raises(ValueError, match=r"no \*\.safetensors files there"):
        checkpoint_files(tmp_path)
