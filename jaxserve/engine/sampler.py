"""Token sampling: one jitted, host-sync-free function of the logits and per-row parameters.

Order of operations (vLLM's): `logit_bias` added to the raw logits, and EOS and stop ids masked
while a row is under `min_tokens` (one scatter); then the penalties; then, for rows under
structured outputs, every token their grammar does not allow next set to -inf (the host's
bitmask, 32 tokens per int32 word, see `jaxserve.structured_outputs`); greedy rows take the argmax
of that; random rows divide by their temperature, keep the tokens that pass top-k, then top-p
(over the top-k set, renormalized), then min-p (relative to the most likely token, so its place
in the chain does not matter), and draw with the exponential race: argmax(p / E), E ~ Exp(1) per
token.

Reported logprobs (`logprobs_mode`, vLLM's `--logprobs-mode`): "raw_logprobs" (the default) the raw
model distribution, log_softmax of the logits before any bias, penalty, mask, temperature or filter;
"processed_logprobs" the distribution the token was drawn from: a greedy row's logits after bias,
min_tokens, penalties and its grammar, a random row's those over its temperature with the tokens top-k,
top-p and min-p drop at -inf, normalized; "raw_logits" and "processed_logits" the same before
normalization. A token's rank and the top logprobs are taken in the same values.

Randomness: each row's key is fold_in(PRNGKey(seed), tokens generated so far), or for rows
without a seed fold_in(fold_in(PRNGKey(engine_seed), request_counter), tokens generated), so
a seeded request draws the same tokens whatever shares its batch and wherever its row sits.
The per-token noise is a counter hash of (row key, token id) rather than threefry because
threefry over a 49152-token vocabulary costs ~440 ms per call at 256 rows on a 2-core CPU
(the hash: ~80 ms); the hash maps distinct token ids to distinct 32-bit values under a key.

Filtering cost: `lax.top_k` over TOP_K_CAP candidates answers top-k <= TOP_K_CAP and any top-p
whose nucleus lies among those candidates. Only when some row needs more (top_k above the cap,
or a nucleus wider than the candidates) does a bisection over the full vocabulary run, inside
a `lax.cond`, so the usual step never pays for it; a full sort is far slower on the CPU
(5.4 s at 256 rows against 55 ms for `lax.top_k` with 128). Rows resolved by the candidates use
the same arithmetic in both branches, so the branch taken never changes a row's token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.engine.penalties import apply_penalties
from jaxserve.engine.sampling_noise import exponential_noise
from jaxserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from jaxserve.structured_outputs import bitmask_width

TOP_K_CAP = 128
"""Candidates the fast top-k/top-p path examines per row."""

_BISECT_STEPS = 32  # one per bit of a float32's order key: the search ends exact


@functools.partial(jax.tree_util.register_dataclass)
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as arrays; row i belongs to the i-th request in the batch."""

    temperature: jax.Array  # [S] f32, 1 on greedy and padding rows
    greedy: jax.Array  # [S] bool
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] f32, 1 = off
    min_p: jax.Array  # [S] f32, 0 = off
    repetition_penalty: jax.Array  # [S] f32, 1 = off
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    key_data: jax.Array  # [S, 2] uint32, threefry key of the seed (or of the engine seed)
    seeded: jax.Array  # [S] bool
    stream: jax.Array  # [S] uint32, per-request counter folded in when not seeded
    step: jax.Array  # [S] int32, tokens the request has generated so far
    min_tokens: jax.Array  # [S] int32
    stop_ids: jax.Array  # [S, M] int32, ids masked while step < min_tokens; -1 pads
    bias_ids: jax.Array  # [S, MAX_LOGIT_BIAS] int32, logit_bias token ids; -1 pads
    bias_values: jax.Array  # [S, MAX_LOGIT_BIAS] f32, their biases
    constrained: jax.Array  # [S] bool, the row samples under a grammar
    token_bitmask: jax.Array  # [S, ceil(V / 32)] int32, bit t % 32 of word t // 32: token t allowed

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        num_generated: Sequence[int],
        padded_size: int,
        vocab_size: int,
        eos_ids: Sequence[int],
        *,
        request_counters: Sequence[int] | None = None,
        engine_seed: int = 0,
        stop_ids_width: int = 8,
        token_bitmask: np.ndarray | None = None,
        constrained: Sequence[bool] | None = None,
    ) -> SamplingTensors:
        """Build host arrays for a batch, padded to `padded_size` rows with inert greedy rows.

        `request_counters` give unseeded requests distinct random streams (default: row index);
        `stop_ids_width` is the minimum width of `stop_ids`, grown to a power of two if needed;
        `token_bitmask` ([padded_size, ceil(vocab_size / 32)] int32) holds the tokens each row in
        `constrained` may sample (other rows' words are ignored).
        """
        n = len(params)
        if n > padded_size:
            raise ValueError(f"{n} requests do not fit in padded_size {padded_size}")
        if len(num_generated) != n:
            raise ValueError(f"num_generated has {len(num_generated)} entries for {n} requests")
        if request_counters is not None and len(request_counters) != n:
            raise ValueError(f"request_counters has {len(request_counters)} entries for {n} requests")
        S = padded_size
        W = bitmask_width(vocab_size)
        if token_bitmask is None:
            token_bitmask = _all_allowed(S, W)
        elif token_bitmask.shape != (S, W) or token_bitmask.dtype != np.int32:
            raise ValueError(f"token_bitmask must be int32 of shape {(S, W)}, got {token_bitmask.dtype} "
                             f"{token_bitmask.shape}")
        rows_constrained = np.zeros(S, bool)
        if constrained is not None:
            if len(constrained) != n:
                raise ValueError(f"constrained has {len(constrained)} entries for {n} requests")
            rows_constrained[:n] = constrained
        temperature = np.ones(S, np.float32)
        greedy = np.ones(S, bool)
        top_k = np.zeros(S, np.int32)
        top_p = np.ones(S, np.float32)
        min_p = np.zeros(S, np.float32)
        rep = np.ones(S, np.float32)
        pres = np.zeros(S, np.float32)
        freq = np.zeros(S, np.float32)
        key_data = np.tile(_threefry_key_data(engine_seed), (S, 1))
        seeded = np.zeros(S, bool)
        stream = np.arange(S, dtype=np.uint32)
        step = np.zeros(S, np.int32)
        min_tokens = np.zeros(S, np.int32)
        stops: list[list[int]] = []
        bias_ids = np.full((S, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((S, MAX_LOGIT_BIAS), np.float32)
        for i, p in enumerate(params):
            greedy[i] = p.is_greedy
            if not p.is_greedy:
                temperature[i] = p.temperature
                top_k[i] = p.top_k
                top_p[i] = p.top_p
                min_p[i] = p.min_p
            rep[i] = p.repetition_penalty
            pres[i] = p.presence_penalty
            freq[i] = p.frequency_penalty
            if p.seed is not None:
                seeded[i] = True
                key_data[i] = _threefry_key_data(p.seed)
            if request_counters is not None:
                stream[i] = request_counters[i] % 2**32
            step[i] = num_generated[i]
            min_tokens[i] = p.min_tokens
            stops.append(p.all_stop_token_ids(eos_ids) if p.min_tokens > num_generated[i] else [])
            if p.logit_bias:
                bias_ids[i, : len(p.logit_bias)] = list(p.logit_bias)
                bias_values[i, : len(p.logit_bias)] = list(p.logit_bias.values())
        width = max(stop_ids_width, max((len(s) for s in stops), default=0))
        width = 1 << (width - 1).bit_length()
        stop_ids = np.full((S, width), -1, np.int32)
        for i, s in enumerate(stops):
            stop_ids[i, : len(s)] = s
        return cls(
            temperature,
            greedy,
            top_k,
            top_p,
            min_p,
            rep,
            pres,
            freq,
            key_data,
            seeded,
            stream,
            step,
            min_tokens,
            stop_ids,
            bias_ids,
            bias_values,
            rows_constrained,
            token_bitmask,
        )

    def advance(self) -> SamplingTensors:
        """The same rows one generated token later (for decode loops that stay on the device)."""
        return dataclasses.replace(self, step=self.step + 1)


@functools.partial(jax.tree_util.register_dataclass)
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """The chosen tokens and their logprobs (in the sampler's `logprobs_mode`)."""

    token_ids: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] f32, of the chosen token
    ranks: jax.Array  # [S] int32, 1 + tokens strictly more likely than the chosen one
    top_ids: jax.Array  # [S, k] int32, most likely first
    top_logprobs: jax.Array  # [S, k] f32
    scores: jax.Array | None = None  # [S, V] f32, every token's reported value; None in "raw_logprobs"


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "logprobs_mode"))
def sample(
    logits: jax.Array,
    tensors: SamplingTensors,
    output_token_counts: jax.Array | None = None,
    prompt_token_mask: jax.Array | None = None,
    num_top_logprobs: int = 0,
    logprobs_mode: str = "raw_logprobs",
) -> SamplerOutput:
    """Pick one token per row from `logits` [S, V]; penalties need the count/mask arrays.

    output_token_counts: [S, V] int32, times each token was generated (presence, frequency
    and repetition penalties); prompt_token_mask: [S, V] bool, tokens of the prompt
    (repetition penalty). Left None, the penalties they feed are skipped.
    """
    logits = logits.astype(jnp.float32)
    t = tensors
    raw_lse = jax.nn.logsumexp(logits, axis=-1)  # [S]

    processed = _bias_and_mask_stop_ids(logits, t)
    if output_token_counts is not None or prompt_token_mask is not None:
        wants = jnp.any((t.repetition_penalty != 1) | (t.presence_penalty != 0) | (t.frequency_penalty != 0))
        processed = lax.cond(
            wants,
            lambda x: apply_penalties(x, t, output_token_counts, prompt_token_mask),
            lambda x: x,
            processed,
        )
    processed = lax.cond(jnp.any(t.constrained), lambda x: _apply_bitmask(x, t), lambda x: x, processed)

    greedy_ids = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    if logprobs_mode.startswith("processed"):  # the filtered distribution both draws and reports
        z, e, threshold = _filtered(processed, t)
        token_ids = lax.cond(jnp.any(~t.greedy), lambda: jnp.where(t.greedy, greedy_ids, _draw(z, e, threshold, t)),
                             lambda: greedy_ids)
        scores = jnp.where(z >= jnp.where(t.greedy, -jnp.inf, threshold)[:, None], z, -jnp.inf)  # greedy: T = 1
    else:
        token_ids = lax.cond(
            jnp.any(~t.greedy),
            lambda x: jnp.where(t.greedy, greedy_ids, _draw(*_filtered(x, t), t)),
            lambda x: greedy_ids,
            processed,
        )
        scores = None if logprobs_mode == "raw_logprobs" else logits
    if scores is not None and logprobs_mode.endswith("logprobs"):
        scores = jax.nn.log_softmax(scores, axis=-1)
    values = logits if scores is None else scores
    chosen = jnp.take_along_axis(values, token_ids[:, None], axis=-1)[:, 0]  # [S]
    ranks = 1 + jnp.sum(values > chosen[:, None], axis=-1, dtype=jnp.int32)
    shift = raw_lse if scores is None else jnp.zeros_like(raw_lse)
    if num_top_logprobs > 0:
        top_vals, top_ids = lax.top_k(values, num_top_logprobs)  # [S, k]
        top_logprobs = top_vals - shift[:, None]
    else:
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
    return SamplerOutput(token_ids, chosen - shift, ranks, top_ids.astype(jnp.int32), top_logprobs, scores)


def _bias_and_mask_stop_ids(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """One scatter-add: each row's logit_bias, and -inf on its stop ids while under min_tokens (a
    penalty leaves -inf as it is, so the mask may come first)."""
    S, V = logits.shape
    active = (t.step < t.min_tokens)[:, None] & (t.stop_ids >= 0)  # [S, M]
    ids = jnp.concatenate([jnp.where(active, t.stop_ids, V), jnp.where(t.bias_ids >= 0, t.bias_ids, V)], axis=1)
    values = jnp.concatenate([jnp.full(t.stop_ids.shape, -jnp.inf, jnp.float32), t.bias_values], axis=1)
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], ids.shape)
    return logits.at[rows, ids].add(values, mode="drop")  # V is out of range: dropped


@functools.lru_cache(maxsize=32)
def _all_allowed(rows: int, width: int) -> np.ndarray:
    """A read-only bitmask allowing every token, shared by the steps that constrain no row."""
    mask = np.full((rows, width), -1, np.int32)
    mask.flags.writeable = False
    return mask


def _apply_bitmask(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """-inf on every token a constrained row's grammar does not allow next."""
    S, V = logits.shape
    bits = (t.token_bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(S, -1)[:, :V].astype(bool) | ~t.constrained[:, None]
    return jnp.where(allowed, logits, -jnp.inf)


def _filtered(logits: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's logits over its temperature z [S, V], their unnormalized probabilities [S, V], and the
    smallest z that top-k, top-p and min-p keep [S] (-inf: all)."""
    z = logits / t.temperature[:, None]  # [S, V]
    z_max = jnp.max(z, axis=-1)  # [S]
    e = jnp.exp(z - z_max[:, None])  # [S, V] unnormalized probabilities
    total = jnp.sum(e, axis=-1)  # [S]
    filters = ~t.greedy & ((t.top_k > 0) | (t.top_p < 1) | (t.min_p > 0))
    # The branch takes the logits, not z or e: [S, V] operands of a cond are materialized,
    # which would cost the common unfiltered step two extra passes over memory.
    threshold = lax.cond(
        jnp.any(filters),
        lambda: _thresholds(logits, z_max, total, t),
        lambda: jnp.full(z_max.shape, -jnp.inf),
    )
    return z, e, threshold


def _draw(z: jax.Array, e: jax.Array, threshold: jax.Array, t: SamplingTensors) -> jax.Array:
    """Each random row's token: the exponential race over the probabilities `e` its filters keep."""
    keep = z >= threshold[:, None]
    noise = exponential_noise(_row_keys(t), z.shape[1])  # [S, V]
    return jnp.argmax(jnp.where(keep, e, 0.0) / noise, axis=-1).astype(jnp.int32)


def _thresholds(logits: jax.Array, z_max: jax.Array, total: jax.Array, t: SamplingTensors) -> jax.Array:
    """Per row, the smallest scaled logit that survives top-k, top-p and min-p: [S]."""
    z = logits / t.temperature[:, None]  # [S, V], as in _filtered
    S, V = z.shape
    K = min(TOP_K_CAP, V)
    cand_z, _ = lax.top_k(z, K)  # [S, K], descending
    cum = jnp.cumsum(jnp.exp(cand_z - z_max[:, None]), axis=-1) / total[:, None]  # [S, K]
    k_on = t.top_k > 0
    k_in = k_on & (t.top_k <= K)
    k_idx = jnp.clip(t.top_k, 1, K)[:, None] - 1
    t_k = jnp.where(k_in, jnp.take_along_axis(cand_z, k_idx, axis=-1)[:, 0], -jnp.inf)
    mass_k = jnp.where(k_in, jnp.take_along_axis(cum, k_idx, axis=-1)[:, 0], 1.0)
    p_on = t.top_p < 1
    # The nucleus ends at the first candidate whose inclusive cumulative mass reaches the target.
    j = jnp.sum(cum < (t.top_p * mass_k)[:, None], axis=-1)  # [S], K when not reached
    t_p = jnp.where(
        p_on, jnp.take_along_axis(cand_z, jnp.minimum(j, K - 1)[:, None], axis=-1)[:, 0], -jnp.inf
    )
    needs_full = ~t.greedy & ((k_on & ~k_in) | (p_on & (j >= K)))

    def full(t_k: jax.Array, t_p: jax.Array) -> tuple[jax.Array, jax.Array]:
        zkey = _order_key(z)  # [S, V]
        e = jnp.exp(z - z_max[:, None])  # [S, V]
        lo = jnp.min(zkey, axis=-1)
        hi = _order_key(cand_z[:, K - 1])
        kth = _bisect_max(lambda v: jnp.sum(zkey >= v[:, None], axis=-1) >= t.top_k, lo, hi)
        t_k = jnp.where(needs_full & k_on & ~k_in, _from_order_key(kth), t_k)
        in_k = z >= t_k[:, None]
        mass_k = jnp.sum(jnp.where(in_k, e, 0.0), axis=-1) / total
        target = t.top_p * mass_k

        def reaches(v: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(in_k & (zkey >= v[:, None]), e, 0.0), axis=-1) / total >= target

        lo = jnp.maximum(lo, _order_key(t_k))
        nucleus = _bisect_max(reaches, lo, jnp.maximum(hi, lo))
        t_p = jnp.where(needs_full & p_on, _from_order_key(nucleus), t_p)
        return t_k, t_p

    t_k, t_p = lax.cond(jnp.any(needs_full), full, lambda a, b: (a, b), t_k, t_p)
    t_min = jnp.where(t.min_p > 0, z_max + jnp.log(jnp.maximum(t.min_p, 1e-30)), -jnp.inf)
    return jnp.maximum(jnp.maximum(t_k, t_p), t_min)


def _order_key(x: jax.Array) -> jax.Array:
    """Map float32 to uint32 so that the integer order is the float order."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_key(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _bisect_max(pred, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Largest v in [lo, hi] with pred(v), per row, for pred monotone (true at lo): [S] uint32."""

    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2
        ok = pred(mid) & (lo < hi)
        return jnp.where(ok, mid, lo), jnp.where(ok | (lo >= hi), hi, mid - 1)

    lo, _ = lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return lo


def _row_keys(t: SamplingTensors) -> jax.Array:
    """Each row's key for this step: [S, 2] uint32."""

    def one(key_data, seeded, stream, step):
        key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        unseeded = jax.random.key_data(jax.random.fold_in(key, stream))
        key = jax.random.wrap_key_data(jnp.where(seeded, key_data, unseeded), impl="threefry2x32")
        return jax.random.key_data(jax.random.fold_in(key, step))

    return jax.vmap(one)(t.key_data, t.seeded, t.stream, t.step)


def _threefry_key_data(seed: int) -> np.ndarray:
    """jax.random.PRNGKey(seed)'s data for 0 <= seed < 2**32; other seeds use all 64 bits."""
    seed %= 2**64
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
