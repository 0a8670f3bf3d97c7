"""`LLM`: offline batch generation, as vLLM's `LLM` class offers it."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.beam_search import BeamSearchOutput, BeamSearchParams, beam_search, one_token_params
from jaxserve.engine.admission import without_tokenizer
from jaxserve.engine.classifier import cross_encoder_prompt
from jaxserve.engine.errors import EngineError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.multimodal import image_spec, images_of, media_data
from jaxserve.engine_args import EngineArgs
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    TokenLogprobs,
)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Load a model once and generate for many prompts at a time.

    `model=None` serves the bundled SmolLM2-135M-Instruct; other keyword arguments are
    `EngineArgs` fields (`max_num_seqs`, `max_model_len`, `dtype`, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        progress = engine_args.pop("progress", True)
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args), progress=progress)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no sampling parameters: the model's generation config's
        sampling defaults (`jaxserve.generation_config`), else `SamplingParams()`."""
        return SamplingParams(**self.engine.model.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": [...]} / {"prompt": ...}, with
        {"multi_modal_data": {"image": ..., "video": ...}} for an image-text model's images (and Qwen2-VL's videos),
        one placeholder in the prompt for each), in input order; with `lora_request` (one for all, or one per prompt), through a LoRA adapter
        (`enable_lora=True`)."""
        prompts = self._prompt_list(prompts)
        params = self._params_list(sampling_params or self.get_default_sampling_params(), len(prompts))
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        return self._run(self._add_all(prompts, params, priority, loras), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        continue_final_message: bool = False,
        documents: Sequence[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or `chat_template`, a template's
        text) and generate its reply. `tools` (function tools, as in OpenAI's API) are given to the
        template; to make the reply a call, constrain it with `SamplingParams(structured_outputs=...)`
        to the function's parameters. `continue_final_message` continues a final (assistant) message instead of
        starting a reply (`add_generation_prompt` is then off); `documents` go to the template, for
        retrieval-augmented models."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok, spec = self.engine.tokenizer, image_spec(self.engine)
        if tok is None:
            raise without_tokenizer("chat (the chat template renders text)")
        extra = dict(chat_template_kwargs or {}) | ({"documents": list(documents)} if documents is not None else {})
        prompts: list[Prompt] = []
        for conv in conversations:
            images: list[Any] = []  # an image-text model's: image parts' images (PIL images or URLs) in order
            more = {"images": images, "image_placeholder": spec.placeholder,
                    "video_placeholder": spec.video_placeholder} if spec else {}
            ids = tok.encode_chat(conv, add_generation_prompt=add_generation_prompt and not continue_final_message,
                                  tools=tools, chat_template=chat_template,
                                  continue_final_message=continue_final_message, **extra, **more)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": media_data(images)} if images else ids)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of each prompt (text, token ids, or {"prompt_token_ids": [...]}), in input order;
        the model must run as an embedding model (`runner="pooling"`)."""
        return self._pool(prompts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens)

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """The class probabilities of each prompt (`outputs.probs`, in label order), in input order; the model
        must be a sequence classification model run with `runner="pooling"`."""
        return self._pool(prompts, pooling_params, "classify", use_tqdm, truncate_prompt_tokens)

    def _pool(self, prompts: Prompt | Sequence[Prompt], pooling_params: Any, task: str, use_tqdm: bool,
              truncate_prompt_tokens: int | None) -> list[Any]:
        prompts = self._prompt_list(prompts)
        params = [dataclasses.replace(p, task=task, **({} if truncate_prompt_tokens is None else
                                                       {"truncate_prompt_tokens": truncate_prompt_tokens}))
                  for p in self._params_list(pooling_params, len(prompts), PoolingParams)]
        return self._run(self._add_all(prompts, params), use_tqdm)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """Each pair's score: `text_1` against each of `text_2` when it is one text, else element by element
        (the `/score` endpoint's pairing). A cross-encoder (a classification model with one label) reads each
        pair as one input, the tokenizer's pair encoding (or `chat_template`, a score template, rendered over
        the roles "query" and "document"), and scores its relevance; an embedding model scores the cosine
        similarity of the two embeddings, each distinct text embedded once."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or lists "
                             "of the same length")
        head = getattr(self.engine, "classifier", None)
        if head is not None:
            if not head.is_cross_encoder:
                raise ValueError(f"this model classifies into {head.num_labels} labels; scoring needs a cross-encoder "
                                 "(one label) or an embedding model")
            if (tok := self.engine.tokenizer) is None:
                raise without_tokenizer("scoring text pairs")
            pairs = [cross_encoder_prompt(tok, a, b, chat_template) for a, b in zip(first, second, strict=True)]
            outs = self.classify(pairs, PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens), use_tqdm)
            return [ScoringRequestOutput(str(next(self._ids)), o.prompt_token_ids, ScoringOutput(o.outputs.probs[0]))
                    for o in outs]
        distinct = list(dict.fromkeys(first + second))
        params = PoolingParams(normalize=True, truncate_prompt_tokens=truncate_prompt_tokens)
        outs = dict(zip(distinct, self.embed(distinct, params, use_tqdm=use_tqdm), strict=True))
        results = []
        for a, b in zip(first, second, strict=True):
            u, v = np.asarray(outs[a].outputs.embedding, np.float64), np.asarray(outs[b].outputs.embedding, np.float64)
            results.append(ScoringRequestOutput(str(next(self._ids)), outs[a].prompt_token_ids + outs[b].prompt_token_ids,
                                                ScoringOutput(float(np.clip(u @ v, -1.0, 1.0)))))
        return results

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The best `params.beam_width` beams of each prompt, best first (jaxserve/beam_search.py). A prompt with
        images ({"multi_modal_data": ...}) is searched on its own, its placeholders expanded first, every step's
        requests taking its images along."""
        engine, spec = self.engine, image_spec(self.engine)
        ids, media = [], []
        for p in self._prompt_list(prompts):
            tokens = engine.tokenize_prompt(p.get("prompt_token_ids", p.get("prompt")) if isinstance(p, dict) else p)
            images = images_of(p.get("multi_modal_data")) if isinstance(p, dict) else []
            if images and spec is not None:  # the beams extend the expanded prompt (else the engine refuses)
                spec.check_count(images)
                images = spec.load(images)
                tokens = spec.expanded(tokens, images)
            ids.append(tokens)
            media.append(media_data(images) if images else None)

        def search(indices: list[int], mm: dict | None) -> list[BeamSearchOutput]:
            def next_logprobs(token_lists: list[list[int]], k: int) -> list[TokenLogprobs]:
                asks = [{"prompt_token_ids": t, "multi_modal_data": mm} for t in token_lists] if mm else token_lists
                outs = self._run(self._add_all(asks, [one_token_params(k)] * len(token_lists)), False)
                return [out.outputs[0].logprobs[0] for out in outs]

            return beam_search([ids[i] for i in indices], params, max_model_len=engine.max_model_len,
                               eos_token_ids=engine.eos_ids,  # (no tokenizer, `skip_tokenizer_init`: no text)
                               decode=engine.tokenizer.decode if engine.tokenizer else lambda *_, **__: "",
                               next_logprobs=next_logprobs)

        text = [i for i, mm in enumerate(media) if mm is None]
        found = dict(zip(text, search(text, None) if text else [], strict=True))
        found.update({i: search([i], mm)[0] for i, mm in enumerate(media) if mm is not None})
        return [found[i] for i in range(len(ids))]

    # -- sleep mode and weight updates (jaxserve.engine.memory; the engine must be idle) ---------------

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and the weights on the device: level 1 keeps the weights in host memory, level 2
        drops them (`enable_sleep_mode=True` is needed)."""
        self.engine.memory.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the device memory back: "weights", "kv_cache", or both (None)."""
        self.engine.memory.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.memory.asleep

    def load_weights(self, source: Any = None) -> None:
        """Replace the weights with new ones of the same shapes: a checkpoint's (`source` a path; None: the model's
        own, read again), or tensors in memory (a mapping, or pairs, of HF parameter names and arrays)."""
        self.engine.memory.load_weights(source)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while a KV transfer holds some of its pages."""
        return self.engine.reset_prefix_cache()

    @staticmethod
    def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _add_all(self, prompts: list[Prompt], params: Sequence[Any], priority: Sequence[int] | None = None,
                 loras: Sequence[Any] | None = None) -> list[str]:
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            extra = {"lora_request": loras[i]} if loras and loras[i] is not None else {}
            if isinstance(prompt, dict):
                if prompt.get("multi_modal_data"):
                    extra["multi_modal_data"] = prompt["multi_modal_data"]
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt", prompt.get("prompt_embeds")))
            rid = str(next(self._ids))
            self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0, **extra)
            ids.append(rid)
        return ids

    @staticmethod
    def _params_list(given: Any, n: int, kind: type = SamplingParams) -> list[Any]:
        """One `kind` (sampling or pooling params) per prompt: the default, one for all, or one each."""
        if given is None or isinstance(given, kind):
            return [given or kind()] * n
        params = list(given)
        if len(params) != n:
            kind_name = "sampling" if kind is SamplingParams else "pooling"
            raise ValueError(f"got {len(params)} {kind_name} params for {n} prompts")
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        results: dict[str, Any] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                for request_id, error in getattr(self.engine, "take_failures", dict)().items():
                    raise EngineError(f"request {request_id} failed in the engine: {error}") from error
                for out in outputs:
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]
