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


def expand_grids(ids: Sequence[int], layouts: Sequence[list[int]], image: int,
                 end: int) -> tuple[list[int], list[tuple[int, int]]]:
    """`ids` with each image's placeholder (one `image` token) as its layout (Pixtral's rows of image tokens and
    breaks: `vision_pixtral.pixtral_prompt_tokens`), and where each image's layout is (first position, number of
    tokens). A prompt holding `end` tokens is taken as expanded already: each image's layout runs from the first of
    its image tokens to its image end, and must be the image's."""
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    if end in ids:
        prev = 0
        for layout in layouts:
            first = next((j for j in range(prev, len(ids)) if ids[j] == image), None)
            if first is None or list(ids[first:first + len(layout)]) != layout:
                raise ValueError(f"the prompt's expanded image {len(spans) + 1} is not that image's layout of "
                                 f"{len(layout)} tokens: send one placeholder (token {image}) per image instead")
            spans.append((first, len(layout)))
            prev = first + len(layout)
        if image in ids[prev:] or end in ids[prev:]:
            raise ValueError(f"the prompt holds more expanded images than its {len(layouts)} image(s)")
        return list(ids), spans
    at = [j for j, t in enumerate(ids) if t == image]
    if len(at) != len(layouts):
        raise ValueError(f"the prompt has {len(at)} image placeholder(s) (token {image}) for {len(layouts)} "
                         "image(s): put one placeholder where each image goes")
    prev = 0
    for j, layout in zip(at, layouts, strict=True):
        out.extend(ids[prev:j])
        spans.append((len(out), len(layout)))
        out.extend(layout)
        prev = j + 1
    out.extend(ids[prev:])
    return out, spans
