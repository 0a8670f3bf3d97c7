"""An image's placeholder in a prompt's token ids expanded to the tokens the image takes."""

from __future__ import annotations

from collections.abc import Sequence


def expand_placeholders(ids: Sequence[int], token: int, counts: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """`ids` with the placeholder of each image i (one `token`, or `counts[i]` of them already expanded) as
    `counts[i]` tokens, and where each image's tokens are (first position, number). Images side by side make one
    run of `token`, read in image order: `counts[i]` tokens where that many remain, else one placeholder."""
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    prev, i = 0, 0
    runs = _runs(ids, token)
    for start, length in runs:
        out.extend(ids[prev:start])
        left = length
        while left > 0 and i < len(counts):
            left -= counts[i] if left >= counts[i] else 1
            spans.append((len(out), counts[i]))
            out.extend([token] * counts[i])
            i += 1
        if left:
            break
        prev = start + length
    else:
        if i == len(counts):
            out.extend(ids[prev:])
            return out, spans
    raise ValueError(f"the prompt's image placeholders ({sum(n for _, n in runs)} of token {token}, in {len(runs)} "
                     f"run(s)) do not match {len(counts)} image(s) of {list(counts)} tokens: put one placeholder "
                     "where each image goes (or each image's tokens expanded whole)")


def _runs(ids: Sequence[int], tok: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `tok` in ids."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == tok:
            j = i
            while j < len(ids) and ids[j] == tok:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
