"""A scheduler plan as the runner's padded device inputs, and the runner's outputs back per request."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxserve.engine.admission import banned_now
from jaxserve.engine.request_state import RequestGroup, SeqState
from jaxserve.engine.runner import MAX_STOP_IDS, DecodeState, RunnerConfig, StepOutput
from jaxserve.engine.sampler import SamplingTensors
from jaxserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from jaxserve.models.inputs import ModelInputs
from jaxserve.outputs import token_logprobs
from jaxserve.structured_outputs import bitmask_width


def long_prompts(rows: Sequence[ScheduledRequest], request_of: Callable[[str], Any],
                 long_rope_context: int | None) -> list[bool] | None:
    """Per row, whether its request's prompt is longer than the original context of the LongRoPE model an engine
    serves past it (`RunnerConfig.long_rope`); None in other engines."""
    if long_rope_context is None:
        return None
    return [request_of(s.request_id).num_prompt_tokens > long_rope_context for s in rows]


def mixed_inputs(scheduled: Sequence[ScheduledRequest], rcfg: RunnerConfig,
                 lora_slots: Sequence[int] | None = None, merge: bool = False,
                 long_prompts: Sequence[bool] | None = None,
                 images: Callable[[Sequence[ScheduledRequest], int], Any] | None = None,
                 rope: Callable[[Sequence[ScheduledRequest], int], np.ndarray] | None = None,
                 state_slots: Sequence[int] | None = None) -> tuple[ModelInputs, int]:
    """Inputs of one mixed step (prefill chunks and decodes) padded to its token bucket, and its row count;
    `lora_slots` (a LoRA engine's): each row's adapter slot; `long_prompts` (`RunnerConfig.long_rope`): whether
    each row's prompt is longer than the LongRoPE model's original context; `images(rows, T)` (an image-text
    engine's): the step's image embeddings and mask (`image_prompt.step_embeds`), or None; `rope(rows, T)` (an M-RoPE
    image-text engine's): the step's rotary offsets (`image_prompt.step_rope_offsets`); `state_slots` (a hybrid
    model's engine): each row's state slot.

    With `merge`, consecutive rows of one request at consecutive positions (a drafted decode's row and its
    draft rows, `speculative.draft_rows`) go as one sequence of that many query tokens, with the logits
    of each: its attention reads the request's pages once, not once per row."""
    T = rcfg.token_bucket(sum(s.num_new_tokens for s in scheduled))
    S = min(T, rcfg.max_num_seqs)
    seqs: list[tuple[list[int], int, list[int]]] = []
    rows: list[int] = []
    slots: list[int] = []
    longs: list[bool] = []
    states: list[int] = []
    prev = None
    for i, s in enumerate(scheduled):
        if (merge and prev is not None and s.request_id == prev.request_id
                and s.start_position == prev.start_position + prev.num_new_tokens):
            seqs[-1][0].extend(s.token_ids)
            rows[-1] += 1
        else:
            seqs.append((list(s.token_ids), s.start_position, list(s.page_table)))
            rows.append(1)
            if lora_slots is not None:
                slots.append(lora_slots[i])
            if state_slots is not None:
                states.append(state_slots[i])
            if long_prompts is not None:
                longs.append(long_prompts[i])
        prev = s
    merged = len(seqs) < len(scheduled)
    inputs = ModelInputs.build(seqs, rcfg.page_size, num_tokens=T, num_seqs=S, pages_per_seq=rcfg.pages_per_seq,
                               lora_slots=None if lora_slots is None else slots,
                               long_prompts=None if long_prompts is None else longs,
                               logit_rows=rows if merged else None,
                               state_slots=None if state_slots is None else states)
    got = images(scheduled, T) if images is not None else None
    if got is not None:
        inputs = dataclasses.replace(inputs, image_embeds=got[0], image_mask=got[1], last_key=got[2])
    if rope is not None:
        inputs = dataclasses.replace(inputs, rope_offsets=jnp.asarray(rope(scheduled, T)))
    return inputs, S


def decode_state(scheduled: Sequence[ScheduledRequest], seqs: Sequence[SeqState], rcfg: RunnerConfig,
                 reserve_pages: Callable[[str, int], int], pages_of: Callable[[str], list[int]],
                 num_steps: int | None = None, lora_slots: Sequence[int] | None = None,
                 long_prompts: Sequence[bool] | None = None, rope_deltas: Sequence[int] | None = None,
                 state_slots: Sequence[int] | None = None) -> DecodeState:
    """The decode loop's state for running decodes, padded to their sequence bucket.

    `reserve_pages(request_id, n)` reserves the pages of up to n more tokens and returns how many
    tokens it covered; `pages_of(request_id)` is the request's page table after that. `num_steps`
    (at most the runner's `num_scheduler_steps`, its default) caps the loop's steps; `lora_slots` and
    `long_prompts` are each row's as `mixed_inputs` takes them; `rope_deltas` (an M-RoPE image-text engine's) each
    row's rotary offset (`image_prompt.ImagePrompt.rope_delta`); `state_slots` (a hybrid model's) each row's state slot."""
    S = rcfg.seq_bucket(len(scheduled))
    n = min(num_steps or rcfg.num_scheduler_steps, rcfg.num_scheduler_steps)
    tokens = np.zeros(S, np.int32)
    positions = np.zeros(S, np.int32)
    tables = np.zeros((S, rcfg.pages_per_seq), np.int32)
    max_steps = np.zeros(S, np.int32)
    stop_ids = np.full((S, MAX_STOP_IDS), -1, np.int32)
    min_left = np.zeros(S, np.int32)
    for i, (s, seq) in enumerate(zip(scheduled, seqs, strict=True)):
        steps = reserve_pages(s.request_id, n) if n > 1 else 1
        pages = pages_of(s.request_id)
        tokens[i] = s.token_ids[0]
        positions[i] = s.start_position
        tables[i, : len(pages)] = pages
        max_steps[i] = max(1, steps)
        stop_ids[i, : len(seq.stop_ids)] = seq.stop_ids
        min_left[i] = max(0, seq.params.min_tokens - len(seq.token_ids))

    def padded(values: Sequence | None, pad: object, dtype: type) -> np.ndarray | None:
        if values is None:
            return None
        out = np.full(S, pad, dtype)
        out[: len(values)] = values
        return out

    return DecodeState(tokens, positions, tables, max_steps, stop_ids, min_left, np.int32(max(max_steps)),
                       padded(lora_slots, -1, np.int32), padded(long_prompts, False, np.bool_),
                       padded(rope_deltas, 0, np.int32), padded(state_slots, 0, np.int32))


def token_bitmask(scheduled: Sequence[ScheduledRequest], seqs: Sequence[SeqState], S: int, vocab_size: int,
                  outputs: Sequence[Sequence[int]]) -> tuple[np.ndarray | None, list[bool] | None]:
    """The token masks of a step ([S, ceil(V / 32)] int32) and the rows they constrain; (None, None) when no row
    is masked. A row's mask is its grammar's, within its allowed token ids, without what its bad words forbid
    after its output tokens (`outputs`). Only rows that sample this step get a mask (not a prompt chunk before the
    last)."""
    if not any(q.masked for q in seqs):
        return None, None
    constrained = [q.masked and s.sample for q, s in zip(seqs, scheduled, strict=True)]
    bitmask = np.full((S, bitmask_width(vocab_size)), -1, np.int32)
    i = 0
    while i < len(seqs):
        # A drafted decode's rows follow it, one per draft (`speculative.draft_rows`): each row's mask
        # is its grammar's after the drafts before it.
        end = i + 1
        while end < len(seqs) and scheduled[end].request_id == scheduled[i].request_id:
            end += 1
        if constrained[i] and seqs[i].matcher is not None:
            seqs[i].matcher.fill_bitmasks(bitmask, i, [scheduled[r].token_ids[0] for r in range(i + 1, end)])
        i = end
    words = bitmask.view(np.uint32)
    for i, q in enumerate(seqs):
        if constrained[i] and q.params.allowed_token_ids is not None:
            words[i] &= allowed_words(q.params.allowed_token_ids, vocab_size)
        for t in banned_now(q.bad_words, outputs[i]) if constrained[i] else ():
            words[i, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    return bitmask, constrained


@functools.lru_cache(maxsize=256)
def allowed_words(allowed: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """The mask words ([ceil(V / 32)] uint32) allowing just these token ids."""
    words = np.zeros(bitmask_width(vocab_size), np.uint32)
    ids = np.asarray(allowed, np.int64)
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    words.flags.writeable = False
    return words


@dataclass(frozen=True)
class PromptChunk:
    """Packed tokens [q0, q0 + count) of a mixed step, whose next prompt tokens (positions first ..
    first + count - 1) have their logprobs computed for `group`."""

    q0: int
    first: int
    count: int
    group: RequestGroup
    top: int  # top logprobs per position


def prompt_logprob_chunks(scheduled: Sequence[ScheduledRequest], seqs: Sequence[SeqState | None],
                          groups: Sequence[RequestGroup | None]) -> list[PromptChunk]:
    """The prompt chunks of a mixed step whose prompt logprobs are due: the first completion's, until
    its prompt is whole (not again after a preemption)."""
    chunks, q0 = [], 0
    for s, seq, group in zip(scheduled, seqs, groups, strict=True):
        if group is not None and seq is not None and seq.index == 0 and group.prompt_logprobs is not None:
            last = len(group.prompt_ids) - 1  # the last prompt position whose logprob is due
            count = min(s.start_position + s.num_new_tokens, last) - s.start_position
            if not s.is_decode and count > 0 and len(group.prompt_logprobs) < last:
                chunks.append(PromptChunk(q0, s.start_position + 1, count, group, seq.params.prompt_logprobs or 0))
        q0 += s.num_new_tokens
    return chunks


def prompt_next_ids(chunks: Sequence[PromptChunk], num_tokens: int) -> np.ndarray | None:
    """Per packed token, the prompt token whose logprob it yields (-1: none); None without chunks."""
    if not chunks:
        return None
    next_ids = np.full(num_tokens, -1, np.int32)
    for c in chunks:
        next_ids[c.q0:c.q0 + c.count] = c.group.prompt_ids[c.first:c.first + c.count]
    return next_ids


def take_prompt_logprobs(chunks: Sequence[PromptChunk], prompt: Any, tokenizer: Any) -> None:
    """A fetched step's prompt logprobs (`PromptLogprobs` on the host) into their requests (their tokens' text unless
    the request's output is not detokenized)."""
    for c in chunks:
        text = tokenizer is not None and c.group.seqs[0].has_text
        for i in range(c.count):
            q, p = c.q0 + i, c.first + i
            entry = token_logprobs(c.group.prompt_ids[p], prompt.logprobs[q], prompt.ranks[q],
                                   prompt.top_ids[q][:c.top].tolist(), prompt.top_logprobs[q][:c.top].tolist())
            for tid, item in entry.items():
                item.decoded_token = tokenizer.decode([tid], skip_special_tokens=False) if text else None
            c.group.prompt_logprobs[p] = entry


def row(out: StepOutput, i: int, n: int) -> StepOutput:
    """Row i of a step's output as per-token arrays of length n."""
    if out.token_ids.ndim == 1:
        return StepOutput(out.token_ids[i:i + 1], out.logprobs[i:i + 1], out.ranks[i:i + 1],
                          out.top_ids[i:i + 1], out.top_logprobs[i:i + 1], np.int32(1))
    return StepOutput(out.token_ids[:n, i], out.logprobs[:n, i], out.ranks[:n, i], out.top_ids[:n, i],
                      out.top_logprobs[:n, i], np.int32(n))


def sampled_rows(plan: SchedulerOutput, kind: str, out: StepOutput) -> dict[str, StepOutput]:
    """A fetched step's outputs per request: one token per sampling row of a mixed step, or each
    row's `num_generated` tokens of a decode loop."""
    if kind == "mixed":
        return {s.request_id: row(out, i, 1) for i, s in enumerate(plan.scheduled) if s.sample}
    return {s.request_id: row(out, i, int(out.num_generated[i])) for i, s in enumerate(plan.scheduled)}


def step_shapes(plan: SchedulerOutput, rcfg: RunnerConfig, mcfg: Any, rows: Sequence[ScheduledRequest] | None = None,
                chunked: bool = False) -> tuple[dict, dict]:
    """What a plan runs as, for traces: the bucket (L6) and the attention kernel's shapes (L7). `rows`:
    the step's rows when they are not the plan's (drafts add rows); `chunked`: its drafts are verified as
    chunks, in a mixed step."""
    rows = plan.scheduled if rows is None else rows
    if not chunked and all(s.is_decode for s in plan.scheduled):
        S = rcfg.seq_bucket(len(rows))
        bucket = {"kind": "decode", "num_seqs": S, "pages_per_seq": rcfg.pages_per_seq,
                  "num_scheduler_steps": rcfg.num_scheduler_steps}
        q_tokens = S
    else:
        T = rcfg.token_bucket(sum(s.num_new_tokens for s in rows))
        bucket = {"kind": "mixed", "num_tokens": T, "num_seqs": min(T, rcfg.max_num_seqs),
                  "pages_per_seq": rcfg.pages_per_seq}
        q_tokens = T
    k_dim = mcfg.kv_cache_dims[0]  # (an MLA model's queries are read in its latent's space, as wide as its entries)
    kernel = {"backend": "xla" if mcfg.kv_lora_rank else rcfg.backend,
              "q": [q_tokens, mcfg.num_heads, k_dim if mcfg.kv_lora_rank else mcfg.head_dim],
              "kv_pages": [len(mcfg.attention_layers), rcfg.num_pages, rcfg.page_size, mcfg.kv_pool_heads, k_dim]}
    return bucket, kernel


def sampling_inputs(scheduled: Sequence[ScheduledRequest], seqs: Sequence[SeqState], prompts: Sequence[list[int]],
                    S: int, vocab_size: int, eos_ids: Sequence[int], engine_seed: int,
                    penalty_inputs: Callable[[int, list], Any],
                    outputs: Sequence[list[int]] | None = None) -> tuple[SamplingTensors, bool, Any]:
    """A step's sampling tensors (grammar masks included), whether any row wants top logprobs, and its
    penalty history (None when no row uses a penalty). `prompts`: each row's prompt ids; `outputs`:
    each row's output ids before its token (default: its completion's; a draft row's adds the drafts
    before it)."""
    params = [q.params for q in seqs]
    outputs = [q.token_ids for q in seqs] if outputs is None else outputs
    bitmask, constrained = token_bitmask(scheduled, seqs, S, vocab_size, outputs)
    tensors = SamplingTensors.from_params(
        params, [len(o) for o in outputs], S, vocab_size, eos_ids,
        request_counters=[q.counter for q in seqs], engine_seed=engine_seed,
        token_bitmask=bitmask, constrained=constrained,
    )
    penalties = None
    if any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params):
        penalties = penalty_inputs(S, [(p, o) for p, o in zip(prompts, outputs, strict=True)])
    return tensors, any(p.logprobs for p in params), penalties


def trace_plan(plan: SchedulerOutput, step_id: int, rcfg: RunnerConfig, mcfg: Any,
               get_request: Callable[[str], Any], trace: Callable[..., None], spec: Any = None) -> None:
    """A plan's trace events: L4 schedule decisions, L5 drafts (`spec`, a `SpecStep`), L6 bucket shapes,
    L7 backend and kernel shapes (`trace(request_id, layer, event, **data)`)."""
    bucket, kernel = step_shapes(plan, rcfg, mcfg, spec.rows if spec is not None else None,
                                 spec is not None and spec.drafter.chunked)
    for rid in plan.preempted_ids:
        trace(rid, "L4", "preempted", step=step_id)
    for s in plan.scheduled:
        r = get_request(s.request_id)
        trace(s.request_id, "L4", "scheduled", step=step_id, decode=s.is_decode,
              tokens=s.num_new_tokens, start_position=s.start_position, pages=len(s.page_table),
              prefix_hit_tokens=r.num_cached_tokens if r is not None else 0,
              batch_tokens=plan.num_batched_tokens, batch_seqs=len(plan.scheduled))
        if spec is not None and s.request_id in spec.drafts:
            trace(s.request_id, "L5", "drafts", step=step_id, token_ids=spec.drafts[s.request_id])
        trace(s.request_id, "L6", "bucket", step=step_id, **bucket)
        trace(s.request_id, "L7", "kernel", step=step_id, **kernel)
