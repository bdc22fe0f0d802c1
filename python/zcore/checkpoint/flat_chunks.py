"""A flat element range of an n-d tensor as the boxes DCP describes chunks by.

zcore's shards are ranges of a tensor's flattened (row-major) elements;
torch.distributed.checkpoint stores and reads n-d boxes (an offset and a
size per dimension). A range [start, stop) is a few boxes: the rest of the
first row it begins in, the whole rows after it, the first part of the row
it ends in; each of the partial rows is cut the same way one dimension down.
Every box's elements are consecutive in the flat order, so a box is a view
of a 1-D slice of the range, never a copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    first: int  # its first element in the flattened tensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes, in flat order, that make up elements [start, stop) of a
    tensor of ``shape``; none for an empty range."""
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"range [{start}, {stop}) is not within a tensor of shape {list(shape)}")
    if start == stop:
        return []
    return [Box(start + first, offsets, sizes) for first, offsets, sizes in _boxes(shape, start, stop)]


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(first element relative to ``start``, offsets, sizes) of each box of
    a non-empty range."""
    if len(shape) <= 1:  # a scalar (one element) or a run of a vector
        return [(0, (start,) if shape else (), (stop - start,) if shape else ())]
    row = math.prod(shape[1:])
    first_row, last_row = start // row, (stop - 1) // row
    if first_row == last_row:  # within one row: cut it one dimension down
        return _in_row(shape, first_row, start - first_row * row, stop - first_row * row, 0)
    out = []
    whole_from = first_row
    if start % row:
        out += _in_row(shape, first_row, start % row, row, 0)
        whole_from += 1
    whole_to = last_row + 1 if stop % row == 0 else last_row
    if whole_to > whole_from:
        out.append((whole_from * row - start, (whole_from,) + (0,) * (len(shape) - 1),
                    (whole_to - whole_from,) + tuple(shape[1:])))
    if stop % row:
        out += _in_row(shape, last_row, 0, stop % row, last_row * row - start)
    return out


def _in_row(shape: tuple[int, ...], index: int, start: int, stop: int, first: int) -> list:
    """Boxes of elements [start, stop) of row ``index`` (along the first
    dimension), the row's first box ``first`` elements into the range."""
    return [(first + f, (index,) + offsets, (1,) + sizes) for f, offsets, sizes in _boxes(shape[1:], start, stop)]
