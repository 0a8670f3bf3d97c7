"""Suffix decoding: drafts from the continuations of the context's last tokens in the request's own tokens and in
earlier requests' responses (`--speculative-config '{"method": "suffix"}'`, vLLM's method and keys).

Agents, tools and templated tasks write the same text again and again: a request's answer often repeats an earlier
answer, or its own prompt. Before a step, the context's last tokens (up to `suffix_decoding_max_tree_depth`) are
matched against two stores of token sequences: the request's own (its prompt and output so far) and the responses of
the last `suffix_decoding_max_cached_requests` finished requests. For each length l of the match, the occurrences of
the context's last l tokens vote on what follows: the draft takes, token by token, the continuation most of them
share, while its share of the occurrences (the product of the shares so far, its probability) stays at least
`suffix_decoding_min_token_prob`, and for at most `suffix_decoding_max_spec_factor` * l tokens (and the depth less
l). Every match length and both stores give a draft; the one whose probabilities sum highest is proposed (the tokens
it is expected to get taken). The drafts are verified as any others (`speculative.SpecStep`): outputs are the model's.

This is the suffix tree's counting (Oliaro et al., "SuffixDecoding", as vLLM runs it) over the positions where each
token occurs, filtered on the tokens before them, instead of a tree: no per-position nodes, so a cache of many
responses stays a few bytes a token. A response joins the cache when its request finishes (vLLM's adds responses
as they are written); the oldest leave first."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from jaxserve.engine.request import Request

SEPARATOR = -1  # between sequences of a store: no token matches it, none follows across it


class TokenStore:
    """Token sequences end to end, and where each token id occurs in them."""

    def __init__(self):
        self.tokens = np.full(256, SEPARATOR, np.int32)
        self.size = 0  # tokens[:size] held (a separator ends each finished sequence)
        self.start = 0  # positions below are dropped (the oldest sequences, evicted)
        self._where: dict[int, list] = {}  # token -> [positions array, count]

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens to the last sequence."""
        m = len(new)
        if self.size + m >= len(self.tokens):
            self.tokens = np.concatenate([self.tokens, np.full(max(len(self.tokens), m + 1), SEPARATOR, np.int32)])
        self.tokens[self.size:self.size + m] = new
        for i, t in enumerate(np.asarray(new, np.int64).tolist()):
            entry = self._where.get(t)
            if entry is None:
                entry = self._where[t] = [np.empty(4, np.int64), 0]
            if entry[1] == len(entry[0]):
                entry[0] = np.resize(entry[0], 2 * len(entry[0]))
            entry[0][entry[1]] = self.size + i
            entry[1] += 1
        self.size += m

    def end_sequence(self) -> None:
        """Close the last sequence (its tokens lead to none of the next one's)."""
        self.extend([SEPARATOR])

    def drop_before(self, position: int) -> int:
        """Forget the tokens before `position` (whole sequences, the oldest); when they are most of it, they leave the
        arrays, every position moving down by the number returned (else 0)."""
        self.start = position
        if self.start * 2 <= self.size or self.size <= 1024:
            return 0
        kept = self.tokens[self.start:self.size].copy()
        self.tokens = np.full(256, SEPARATOR, np.int32)
        self.size = self.start = 0
        self._where = {}
        self.extend(kept.tolist())
        return position

    def occurrences(self, token: int) -> np.ndarray:
        """The positions of `token` still held."""
        entry = self._where.get(token)
        if entry is None:
            return np.empty(0, np.int64)
        at = entry[0][:entry[1]]
        return at[at >= self.start] if self.start else at

    def speculate(self, pattern: np.ndarray, max_tokens: int, depth: int, factor: float,
                  min_prob: float) -> tuple[list[int], float]:
        """The best draft after `pattern` (the context's last tokens) and its score: see the module."""
        matches = []  # where each match of the context's last l tokens ends, l = 1, 2, ...
        ends = self.occurrences(int(pattern[-1]))
        for length in range(1, min(len(pattern), depth) + 1):
            if length > 1:
                before = ends - (length - 1)
                ends = ends[(before >= self.start) & (self.tokens[np.maximum(before, 0)] == pattern[-length])]
            if not ends.size:
                break
            matches.append(ends)
        # The longest matches first: a length whose drafts could not reach the best score so far (each adds at most
        # 1) is passed over; on equal scores the shorter match's draft is kept.
        best: tuple[list[int], float] = ([], 0.0)
        for length in range(len(matches), 0, -1):
            most = min(max_tokens, int(length * factor + 1e-6), depth - length)
            if most <= 0 or most < best[1]:
                continue
            draft, score = self._follow(matches[length - 1], most, min_prob)
            if score > 0 and score >= best[1]:
                best = (draft, score)
        return best

    def _follow(self, ends: np.ndarray, most: int, min_prob: float) -> tuple[list[int], float]:
        """From the matches ending at `ends`, the continuation most of them share, token by token (see the module)."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < most and ends.size:
            if ends.size == 1:  # one match left: what follows it, each token at the same probability, to its end
                run = self.tokens[int(ends[0]) + 1:int(ends[0]) + 1 + most - len(draft)]
                stop = np.flatnonzero(run == SEPARATOR)
                run = run[:stop[0]] if stop.size else run
                draft.extend(run.tolist())
                score += prob * len(run)
                break
            nxt = self.tokens[ends + 1]  # (a sequence's last position is followed by its separator)
            ids, counts = np.unique(nxt[nxt != SEPARATOR], return_counts=True)
            if not ids.size:
                break
            j = int(np.argmax(counts))
            prob *= counts[j] / ends.size
            if prob < min_prob:
                break
            draft.append(int(ids[j]))
            score += prob
            ends = ends[nxt == ids[j]] + 1
        return draft, score


class SuffixDecoding:
    """The stores of suffix decoding: each request's own (kept on it) and the finished requests' responses."""

    def __init__(self, depth: int = 24, max_cached_requests: int = 10000, factor: float = 1.0,
                 min_prob: float = 0.1):
        self.depth, self.max_cached, self.factor, self.min_prob = depth, max_cached_requests, factor, min_prob
        self.responses = TokenStore()
        self._cached: deque[int] = deque()  # where each cached response starts, oldest first
        # Data-parallel replicas share one (`sharding.data_parallel`), each stepping in its own thread.
        self._lock = threading.Lock()

    def propose(self, request: Request, k: int) -> np.ndarray:
        """Up to `k` drafts after the request's tokens: the best of its own store's and the cache's."""
        own = request.ngram_index
        if not isinstance(own, _Own):
            own = request.ngram_index = _Own()
        if request.num_tokens > own.synced:
            own.store.extend(request.token_ids_in(own.synced, request.num_tokens))
            own.synced = request.num_tokens
        store = own.store
        pattern = store.tokens[max(0, store.size - self.depth):store.size]
        if pattern.size == 0 or pattern[-1] < 0:  # (an image's cache ids, `multimodal`, are no tokens)
            return np.empty(0, np.int32)
        drafts = [store.speculate(pattern, k, self.depth, self.factor, self.min_prob)]
        if self.max_cached:
            with self._lock:
                drafts.append(self.responses.speculate(pattern, k, self.depth, self.factor, self.min_prob))
        draft = np.asarray(max(drafts, key=lambda d: d[1])[0][:k], np.int32)
        images = np.flatnonzero(draft < 0)  # an image's cache ids are no tokens to draft
        return draft[:images[0]] if images.size else draft

    def finished(self, request: Request) -> None:
        """Cache a finished (or aborted) request's response (the oldest cached one leaving when the cache is full)."""
        if not self.max_cached or not request.output_token_ids:
            return
        with self._lock:
            self._cache(request.output_token_ids)

    def _cache(self, response: Sequence[int]) -> None:
        self._cached.append(self.responses.size)
        self.responses.extend(response)
        self.responses.end_sequence()
        if len(self._cached) > self.max_cached:
            self._cached.popleft()
            moved = self.responses.drop_before(self._cached[0])
            if moved:
                self._cached = deque(at - moved for at in self._cached)


def prediction_drafts(request: Request, k: int) -> np.ndarray:
    """Up to `k` drafts from the request's predicted output (`SamplingParams.prediction`, token ids): what follows
    where its output's last tokens are found in the prediction (the continuation most such places share), each
    match length allowed all `k`; empty without a prediction or a match."""
    prediction = getattr(request.sampling_params, "prediction", None)
    if not prediction or not request.output_token_ids:
        return np.empty(0, np.int32)
    if request.prediction_index is None:
        request.prediction_index = TokenStore()
        request.prediction_index.extend(prediction)
    pattern = np.asarray(request.output_token_ids[-SUFFIX_MATCH:], np.int64)
    draft, _ = request.prediction_index.speculate(pattern, k, len(pattern) + k, float(k), 0.0)
    return np.asarray(draft, np.int32)


SUFFIX_MATCH = 24  # the output's last tokens looked up in a prediction


class _Own:
    """A request's own store (its prompt and output), kept on it (`Request.ngram_index`)."""

    def __init__(self):
        self.store, self.synced = TokenStore(), 0
