"""Prompts given as embeddings (vLLM's `prompt_embeds`, served with `enable_prompt_embeds`): a [N, E] array of what
the model's embedding layer would give, in place of token ids.

Such a prompt runs as an image of N tokens does (`image_prompt.ImagePrompt`): its positions take the given rows in
place of token embeddings, chunk by chunk, and the prefix cache keys them by one id made from a hash of the rows
(negative, never a token), so two requests share cached pages only over the same embeddings. It has no token ids:
its output's `prompt_token_ids` is empty, the penalties count no prompt token, and prompt logprobs are refused.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from jaxserve.config import GEMMA_FAMILIES
from jaxserve.engine.admission import truncated_prompt
from jaxserve.engine.image_prompt import ImagePrompt
from jaxserve.engine.multimodal import admit_images, cache_key
from jaxserve.sampling_params import SamplingParams


def is_embeds(prompt: Any) -> bool:
    """Whether `prompt` is an array of embeddings (numpy, JAX or torch; 2-D) rather than text or token ids."""
    return not isinstance(prompt, (str, list, tuple)) and getattr(prompt, "ndim", None) == 2


def _as_numpy(embeds: Any) -> np.ndarray:
    if type(embeds).__module__.startswith("torch"):  # (a torch tensor, bfloat16 ones too)
        embeds = embeds.detach().float().cpu().numpy()
    return np.asarray(embeds)


def admit_prompt(engine: Any, prompt: Any, params: SamplingParams, multi_modal_data: Any) -> tuple[list[int], Any]:
    """An `LLMEngine` request's prompt ids (placeholders, for a prompt of embeddings) and its images or embeddings
    (`ImagePrompt`, None without); ValueError naming what cannot be served."""
    if not is_embeds(prompt):
        return admit_images(engine, truncated_prompt(engine.tokenize_prompt(prompt), params, engine.max_model_len),
                            multi_modal_data)
    cfg = engine.model.config
    if not engine.args.enable_prompt_embeds:
        raise ValueError("a prompt of embeddings needs the engine started with enable_prompt_embeds "
                         "(--enable-prompt-embeds)")
    if multi_modal_data:
        raise ValueError("a prompt of embeddings takes no images")
    if engine.draft is not None:
        raise ValueError("a prompt of embeddings is not served with a drafting model (speculative method "
                         f"{engine.args.speculative_config.method!r}): its drafts would need the prompt's tokens")
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs: a prompt of embeddings has no tokens to score")
    if cfg.family in GEMMA_FAMILIES:
        raise ValueError(f"prompts of embeddings are not supported for {cfg.family} (its embeddings are scaled "
                         "inside the model)")
    embeds = _as_numpy(prompt)
    if embeds.shape[0] < 1 or embeds.shape[1] != cfg.hidden_size:
        raise ValueError(f"prompt_embeds has shape {embeds.shape}; this model takes [tokens >= 1, {cfg.hidden_size}]")
    if not np.issubdtype(embeds.dtype, np.floating) and embeds.dtype.name != "bfloat16":
        raise ValueError(f"prompt_embeds must be floats, got {embeds.dtype}")
    embeds = np.asarray(truncated_prompt(embeds, params, engine.max_model_len), engine.model.dtype)
    if not np.isfinite(embeds.astype(np.float32)).all():
        raise ValueError("prompt_embeds holds a value that is not finite")
    key = cache_key(hashlib.sha256(b"prompt_embeds" + embeds.tobytes()).digest())
    n = embeds.shape[0]
    return [0] * n, ImagePrompt(spans=[(0, n)], keys=[key], images=[embeds], encode=lambda rows: rows,
                                prompt_embeds=True)
