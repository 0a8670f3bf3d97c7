"""An image's placeholder in a prompt's token ids expanded to the tokens the image takes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any


def expand_placeholders(ids: Sequence[int], token: int, counts: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """`ids` with the placeholder of each image i (one `token`, or `counts[i]` of them already expanded) as
    `counts[i]` tokens, and where each image's tokens are (first position, number). Images side by side make one
    run of `token`, read in image order: `counts[i]` tokens where that many remain, else one placeholder."""
    out, spans, _ = expand_media(ids, {token: counts}, {token: "image"})
    return out, spans


def expand_media(ids: Sequence[int], counts: Mapping[int, Sequence[int]],
                 names: Mapping[int, str]) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
    """`expand_placeholders` over several kinds of item, each with its placeholder token (`counts`: each token's
    items' token counts, in the order the prompt holds them; `names`: each kind's name, for errors): the prompt
    expanded, each item's tokens (first position, number) in prompt order, and which item each is (token, index
    among that token's items)."""
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    order: list[tuple[int, int]] = []
    taken = dict.fromkeys(counts, 0)
    prev, bad = 0, None
    for start, length in _runs(ids, set(counts)):
        token, left = ids[start], length
        out.extend(ids[prev:start])
        while left > 0 and taken[token] < len(counts[token]):
            n = counts[token][taken[token]]
            left -= n if left >= n else 1
            spans.append((len(out), n))
            order.append((token, taken[token]))
            out.extend([token] * n)
            taken[token] += 1
        if left:
            bad = token
            break
        prev = start + length
    else:
        bad = next((t for t in counts if taken[t] != len(counts[t])), None)
    if bad is None:
        out.extend(ids[prev:])
        return out, spans, order
    runs, name = _runs(ids, {bad}), names[bad]
    raise ValueError(f"the prompt's {name} placeholders ({sum(n for _, n in runs)} of token {bad}, in {len(runs)} "
                     f"run(s)) do not match {len(counts[bad])} {name}(s) of {list(counts[bad])} tokens: put one "
                     f"placeholder where each {name} goes (or each {name}'s tokens expanded whole)")


def _runs(ids: Sequence[int], tokens: set[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of one of `tokens` in ids (a run is of one token)."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] in tokens:
            j = i
            while j < len(ids) and ids[j] == ids[i]:
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




def expand_by_kind(ids: Sequence[int], items: Sequence[Any], is_video: Callable[[Any], bool], image: int, video: int,
                   measure: Callable[[Any], Any], expand: Callable[..., tuple[list[int], list, list]]
                   ) -> tuple[list[int], list[tuple[int, int]], list[Any]]:
    """A prompt's images and videos (`items`, each kind in its order) placed at their placeholders (`image`, `video`
    tokens) by `expand` (`expand_media`, each item `measure`d as its token count, or `expand_kinds`, as its layout): the
    prompt expanded, each item's span and the items in prompt order."""
    kinds = {image: [x for x in items if not is_video(x)]}
    if len(kinds[image]) < len(items):
        kinds[video] = [x for x in items if is_video(x)]
    out, spans, order = expand(ids, {t: [measure(x) for x in xs] for t, xs in kinds.items()},
                               {image: "image", video: "video"})
    return out, spans, [kinds[t][i] for t, i in order]


def expand_layouts(ids: Sequence[int], layouts: Sequence[list[int]], token: int) -> tuple[list[int], list[tuple[int, int]]]:
    """`ids` with the i-th image's placeholder (one `token`) as its layout `layouts[i]` (Idefics3's tiles with their
    marks), a layout written out already kept as it is; and where each layout is (first position, number)."""
    out, spans, _ = expand_kinds(ids, {token: layouts}, {token: "image"})
    return out, spans


def expand_kinds(ids: Sequence[int], layouts: Mapping[int, Sequence[list[int]]], names: Mapping[int, str]
                 ) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
    """`expand_layouts` over several kinds of item, each with its placeholder token (`layouts`: each token's items'
    layouts in prompt order; `names`: each kind's name, for errors): the prompt expanded, where each layout is (first
    position, number) in prompt order, and which item each is (token, index among that token's items). At each
    place, the next item of a kind whose layout is written out there is taken as written; a placeholder, as the next
    item of its kind."""
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    order: list[tuple[int, int]] = []
    taken = dict.fromkeys(layouts, 0)
    i = 0
    while i < len(ids):
        pending = {t: layouts[t][taken[t]] for t in layouts if taken[t] < len(layouts[t])}
        written = next((t for t, lay in pending.items() if ids[i] == lay[0] and list(ids[i:i + len(lay)]) == lay),
                       None)
        kind = written if written is not None else ids[i] if ids[i] in layouts else None
        if kind is None:
            out.append(ids[i])
            i += 1
            continue
        if kind not in pending:
            break
        spans.append((len(out), len(pending[kind])))
        order.append((kind, taken[kind]))
        out.extend(pending[kind])
        i += len(pending[kind]) if written is not None else 1
        taken[kind] += 1
    short = next((t for t in layouts if taken[t] != len(layouts[t])), None)
    if i == len(ids) and short is None:
        return out, spans, order
    t = short if short is not None else ids[i]
    raise ValueError(f"the prompt's {names[t]} placeholders ({sum(x == t for x in ids)} of token {t}) do not match "
                     f"{len(layouts[t])} {names[t]}(s): put one placeholder where each {names[t]} goes")
