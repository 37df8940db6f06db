"""Images in prompts: each image's embeddings stand in the token list under ids past the vocabulary (aliases).

A vision model (exl2.models.vision) turns an image into rows of embeddings, one per image token, and the layout of
tokens around them. Every distinct image (by content) gets its own run of alias ids, so prompts stay plain token
lists: the prompt cache tells two images apart by their ids, and a conversation that sends the same image again
finds its pages cached. A job carries the embeddings of its images (`Job.images`), and a prefill whose tokens
include aliases takes those rows (`split`) in place of the embedding table's; sampled tokens are always real ones.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

# the most encoded images kept for reuse; the least recently used go first (sent again, one is encoded again,
# under new ids, so its prompt pages are not reused)
KEEP_IMAGES = 64


def image_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ImageTokens:
    """One image in a prompt: its token layout with aliases for its image tokens, which run from `base` on, one
    per row of `features` [n, H]."""

    ids: tuple[int, ...]
    base: int
    features: torch.Tensor
    grid: Optional[tuple[int, int, int]] = None   # (t, h, w) of the rows in row-major order, for M-RoPE (Qwen2-VL)
    deep: tuple = ()            # Qwen3-VL: per early decoder layer, rows [n, H] added after it (DeepStack)
    time_step: float = 1.0      # M-RoPE time positions from one frame group of a video to the next


class ImageAliases:
    """Alias ids for image embeddings, from `first_id` (the model's vocabulary size) up; ids are never reused.
    Encoded images are kept by key for reuse (KEEP_IMAGES); thread-safe (requests add, the generator reads)."""

    def __init__(self, first_id: int, keep: int = KEEP_IMAGES):
        self.first, self.next, self.keep = first_id, first_id, keep
        self.images: OrderedDict[str, ImageTokens] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: str) -> Optional[ImageTokens]:
        with self.lock:
            found = self.images.get(key)
            if found is not None:
                self.images.move_to_end(key)
            return found

    def add(self, key: str, token_ids: Sequence[int], image_token_id: int, features: torch.Tensor,
            grid: Optional[tuple[int, int, int]] = None, deep: tuple = (), time_step: float = 1.0) -> ImageTokens:
        """Register an encoded image or video: `token_ids` its layout, whose `image_token_id` tokens take
        `features`' rows in order; `grid` their (t, h, w) arrangement where the model places them in 3-D (M-RoPE),
        `time_step` the time positions between frame groups; `deep` the rows the first decoder layers add there
        (DeepStack)."""
        count = sum(1 for t in token_ids if t == image_token_id)
        if count != features.shape[0]:
            raise ValueError(f"The image has {features.shape[0]} embeddings for {count} image tokens.")
        with self.lock:
            base = self.next
            self.next += count
            aliases = iter(range(base, base + count))
            image = ImageTokens(tuple(next(aliases) if t == image_token_id else t for t in token_ids), base, features,
                                grid, tuple(deep), time_step)
            self.images[key] = image
            while len(self.images) > self.keep:
                self.images.popitem(last=False)
        return image


def split(rows: Sequence[Sequence[int]], images: Sequence[Sequence[ImageTokens]], first_alias: int,
          device: torch.device) -> tuple[list[list[int]], Optional[tuple]]:
    """Token rows ready for a forward: aliases replaced by token 0, and (flat positions [n] into the right-padded
    [B, T] batch, embeddings [n, H][, per DeepStack layer rows [n, H]]) to put in their place
    (`DecoderModel.forward`'s `inject`), row b's aliases looked up among images[b]; None when no row holds an
    alias."""
    if not any(t >= first_alias for r in rows for t in r):
        return [list(r) for r in rows], None
    width = max(len(r) for r in rows)
    plain, where, parts, deep = [], [], [], []
    for b, (row, own) in enumerate(zip(rows, images)):
        for j, end, image, first in image_spans(row, own, first_alias):
            if image is None:
                raise KeyError(f"Token {row[j]} is an image token of no image this prompt carries.")
            parts.append(image.features[first:first + end - j])
            deep.append([d[first:first + end - j] for d in image.deep])
            where.extend(range(b * width + j, b * width + end))
        plain.append([0 if t >= first_alias else t for t in row])
    index = torch.tensor(where, dtype=torch.long, device=device)
    if not all(deep):
        return plain, (index, torch.cat(parts).to(device))
    levels = tuple(torch.cat(level).to(device) for level in zip(*deep))
    return plain, (index, torch.cat(parts).to(device), levels)


def image_spans(row: Sequence[int], images: Sequence[ImageTokens],
                first_alias: int) -> Iterator[tuple[int, int, Optional[ImageTokens], int]]:
    """(start, end, image, its first row) of each stretch of `row` whose aliases belong to one of `images` (a run of
    aliases may hold two images back to back: one stretch each); image None for aliases of none of them (the
    stretch then is that one token)."""
    for a, e in image_runs(row, first_alias):
        j = a
        while j < e:
            image = next((im for im in images if im.base <= row[j] < im.base + im.features.shape[0]), None)
            if image is None:
                yield j, j + 1, None, 0
                j += 1
                continue
            first = row[j] - image.base
            end = min(e, j + image.features.shape[0] - first)
            yield j, end, image, first
            j = end


def image_runs(row: Sequence[int], first_alias: int) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive alias ids in `row`: one image's tokens (between its break tokens)."""
    runs: list[tuple[int, int]] = []
    j = 0
    while j < len(row):
        if row[j] < first_alias:
            j += 1
            continue
        end = j + 1
        while end < len(row) and row[end] == row[end - 1] + 1:
            end += 1
        runs.append((j, end))
        j = end
    return runs


def image_limits(rows: Sequence[Sequence[int]], starts: Sequence[int], first_alias: int,
                 device: torch.device) -> Optional[torch.Tensor]:
    """[B, T] the last key position each query of a prefill sees, for models whose image tokens attend to their
    whole image (Gemma 3): its own position, or for an image token the run's last (rows right-padded to T, row b
    starting at position starts[b]); None when no row holds an image token."""
    width = max(len(r) for r in rows)
    out = torch.arange(width).repeat(len(rows), 1) + torch.tensor(list(starts))[:, None]
    found = False
    for b, row in enumerate(rows):
        for a, e in image_runs(row, first_alias):
            out[b, a:e] = starts[b] + e - 1
            found = True
    return out.to(device) if found else None


def whole_images(ids: Sequence[int], start: int, width: int, first_alias: int) -> int:
    """`width` for a prefill chunk ids[start:start + width] that does not end inside an image: cut back to where
    the image begins, or, for an image that begins at `start`, stretched to its end (its tokens must be computed
    together, as each sees all of them)."""
    end = start + width
    if end >= len(ids) or ids[end - 1] < first_alias or ids[end] != ids[end - 1] + 1:
        return width
    begin = end - 1
    while begin > start and ids[begin - 1] >= first_alias and ids[begin] == ids[begin - 1] + 1:
        begin -= 1
    if begin > start:
        return begin - start
    while end < len(ids) and ids[end] == ids[end - 1] + 1:
        end += 1
    return end - start


def mrope_positions(ids: Sequence[int], images: Sequence[ImageTokens],
                    first_alias: int) -> Optional[tuple[torch.Tensor, int]]:
    """The 3-D RoPE positions [3, len(ids)] of a prompt for M-RoPE models (Qwen2-VL), and the shift every token
    after it adds to its index; None when none of its images is laid out in a grid.

    Text tokens advance (t, h, w) together by one. A stretch of an image's or video's rows (grid (t, h, w),
    row-major) sits at the next position plus each row's (time, h, w) index, its time the frame group's index from
    the stretch's first (× time_step, rounded down), and the text after it goes on from one past the largest:
    an image takes fewer positions than tokens, so the shift is negative. (Qwen3-VL's frame groups, set apart by
    timestamps, are stretches of their own, each at time 0.)"""
    segments, cur, j = [], 0, 0
    for k, end, image, first in image_spans(ids, images, first_alias):
        if image is None or image.grid is None:
            return None
        _, h, w = image.grid
        segments.append(torch.arange(k - j).expand(3, -1) + cur)
        cur += k - j
        row = torch.arange(first, first + end - k)
        time = ((row // (h * w) - first // (h * w)).double() * image.time_step).long()
        segments.append(torch.stack((time, row // w % h, row % w)) + cur)
        cur += max(int(time[-1]) + 1, h, w)
        j = end
    if not segments:
        return None
    segments.append(torch.arange(len(ids) - j).expand(3, -1) + cur)
    cur += len(ids) - j
    return torch.cat(segments, 1), cur - len(ids)


def rope_span(rope: Optional[tuple[torch.Tensor, int]], start: int, width: int) -> torch.Tensor:
    """[3, width] M-RoPE positions of a sequence's tokens start..start+width-1 (`mrope_positions`' pair: the
    prompt's own, then index + shift past it; None, a sequence without images: the indices themselves)."""
    positions, shift = rope if rope is not None else (torch.empty(3, 0, dtype=torch.long), 0)
    n = positions.shape[1]
    inside = positions[:, start:min(start + width, n)]
    past = torch.arange(max(start, n), max(start + width, n)).expand(3, -1) + shift
    return torch.cat((inside, past), 1)
