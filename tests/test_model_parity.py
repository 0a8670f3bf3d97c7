"""The bundled SmolLM2 against HF transformers on the same (dequantized, float32) weights."""

from __future__ import annotations

import numpy as np
import pytest

from tests.modelrun import greedy, prompt_logits

pytestmark = pytest.mark.slow


def test_logits_match_transformers_on_chat_prompts(smollm_f32, hf_smollm, chat_prompt_ids):
    import torch

    cfg, params = smollm_f32
    model, _ = hf_smollm
    assert len(chat_prompt_ids) >= 8
    for ids in chat_prompt_ids:
        ours = prompt_logits(cfg, params, ids)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float().numpy()
        rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
        assert rel < 1e-4, f"relative error {rel:.2e} for a prompt of {len(ids)} tokens"
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_32_tokens_match_transformers_generate(smollm_f32, hf_smollm, chat_prompt_ids):
    import torch

    cfg, params = smollm_f32
    model, tok = hf_smollm
    for ids in chat_prompt_ids[:2]:
        ours = greedy(cfg, params, ids, 32)
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id,
            )[0, len(ids):].tolist()
        assert ours == ref, f"ours {tok.decode(ours)!r} != transformers {tok.decode(ref)!r}"


def test_bfloat16_stays_close_to_float32(smollm_path, chat_prompt_ids, smollm_f32):
    import jax.numpy as jnp

    from jaxserve.loader import load_params, open_checkpoint

    cfg, params32 = smollm_f32
    ckpt = open_checkpoint(smollm_path)
    params16 = load_params(ckpt, cfg, jnp.bfloat16, progress=False)
    ids = chat_prompt_ids[0]
    ref = prompt_logits(cfg, params32, ids)
    ours = prompt_logits(cfg, params16, ids, dtype=jnp.bfloat16)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 5e-2, rel
    assert (ours[-1].argmax() == ref[-1].argmax())
