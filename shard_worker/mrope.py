"""M-RoPE positions (Qwen2.5-VL, Qwen3-VL): three per token, (t, h, w), as transformers' get_rope_index
gives them for a prompt with images.

Text tokens count on as usual, all three equal. An image's placeholders (t x h x w patches merged
merge x merge into (h/merge) x (w/merge) tokens, row-major) all start at the position the next text
token would have: t at it, h at it plus the token's row, w at it plus its column. The text after the
image continues from that start plus the image's larger side in tokens. So positions grow more slowly
than the token count, and every token after the prompt (the output) is at its index plus `delta`
(max position + 1 - prompt length, zero or negative), the same in all three components.

The worker computes a sequence's table once, from the prompt and its images' grids (sent once), and
each step takes the rows of its query tokens: no per-token positions on the wire. Plain numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MRopePositions:
    prompt: np.ndarray  # [3, prompt length] int64
    delta: int  # added to a token's index past the prompt (all three components)

    def rows(self, start: int, end: int) -> np.ndarray:
        """[3, end - start]: the positions of tokens start..end-1 (prompt rows, then index + delta)."""
        n = self.prompt.shape[1]
        head = self.prompt[:, start : min(end, n)]
        if end <= n:
            return head
        tail = np.arange(max(start, n), end, dtype=np.int64) + self.delta
        return np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1)


def prompt_positions(
    token_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]], merge: int
) -> MRopePositions:
    """The prompt's table: `grids` are the images' (t, h, w) patch grids in prompt order; each image's
    t*h*w / merge**2 placeholders (image_token_id) come as one run. ValueError when the placeholders do
    not match the grids."""
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.empty((3, len(ids)), dtype=np.int64)
    is_image = ids == image_token_id
    i, pos, images = 0, 0, iter(grids)
    while i < len(ids):
        if not is_image[i]:
            # The run of text up to the next placeholder.
            nxt = np.flatnonzero(is_image[i:])
            end = i + int(nxt[0]) if len(nxt) else len(ids)
            positions[:, i:end] = np.arange(pos, pos + end - i)
            pos += end - i
            i = end
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError(f"the prompt has more image placeholders than its {len(grids)} images")
        t, h, w = (int(x) for x in grid)
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if i + n > len(ids) or not is_image[i : i + n].all():
            raise ValueError(f"an image of grid {(t, h, w)} needs {n} placeholders in a run at {i}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[0, i : i + n] = tt.ravel() + pos
        positions[1, i : i + n] = hh.ravel() + pos
        positions[2, i : i + n] = ww.ravel() + pos
        pos += max(gh, gw)
        i += n
    if next(images, None) is not None:
        raise ValueError(f"the prompt has fewer image placeholder runs than its {len(grids)} images")
    top = int(positions.max()) + 1 if len(ids) else 0
    return MRopePositions(positions, top - len(ids))


def step_positions(query_lens, context_lens, tables) -> np.ndarray:
    """[3, T] positions of a step's tokens: each sequence's query rows from its table, or its plain
    positions (all three equal) where it has none (a text-only prompt)."""
    out = []
    for q, c, table in zip(query_lens.tolist(), context_lens.tolist(), tables, strict=True):
        if table is None:
            out.append(np.broadcast_to(np.arange(c - q, c, dtype=np.int64), (3, q)))
        else:
            out.append(table.rows(c - q, c))
    return np.concatenate(out, axis=1)
