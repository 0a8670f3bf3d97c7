"""The engine of an embedding model (`--runner pooling`): prompts in, one vector each out; or, for a
sequence classification model (`jaxserve.engine.classifier`), one set of class probabilities each.

It is `LLMEngine` with another step: the same model, paged KV cache, chunked prefill and scheduler,
but each step runs `pooler.pool_step` and a request ends when its prompt is computed. Last-token
pooling reads cached prefixes (a repeated prefix is computed once); mean and first-token pooling need
every token's hidden state, so their requests compute the whole prompt. `LLMEngine(args)` with
`runner="pooling"` builds this class.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import numpy as np

from jaxserve.engine.classifier import (
    ClassifierHead,
    classification_architecture,
    model_config,
    read_classifier,
)
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.pooler import PooledSequence
from jaxserve.engine.request import Request
from jaxserve.engine.step_batch import long_prompts, mixed_inputs
from jaxserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
)
from jaxserve.pooling_params import PoolingParams
from jaxserve.rope import prompt_cache_salt

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PoolingGroup:
    """One embedding (or classification) request as the engine tracks it."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    pooled: PooledSequence
    metrics: RequestMetrics
    head: ClassifierHead | None = None
    activation: bool = True
    finished: bool = False
    result: list[float] | None = None
    """The embedding, or the class probabilities (logits without `activation`)."""

    def finish(self) -> None:
        vector = self.pooled.embedding()
        self.result = vector if self.head is None else self.head.scores(np.asarray(vector), self.activation)
        self.finished = True

    def output(self) -> EmbeddingRequestOutput | ClassificationRequestOutput:
        if self.head is not None:
            probs = ClassificationOutput(self.result) if self.result is not None else None
            return ClassificationRequestOutput(self.request_id, self.prompt, self.prompt_ids, probs, self.finished,
                                               self.metrics)
        out = EmbeddingOutput(self.result) if self.result is not None else None
        return EmbeddingRequestOutput(self.request_id, self.prompt, self.prompt_ids, out, self.finished, self.metrics)


def matryoshka_dimensions(model_path: str) -> tuple[bool, list[int] | None]:
    """Whether an HF model directory's config.json declares Matryoshka embeddings (`is_matryoshka`, or
    `matryoshka_dimensions`, which also lists the sizes trained)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return False, None
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    dims = cfg.get("matryoshka_dimensions")
    return bool(cfg.get("is_matryoshka")) or bool(dims), list(dims) if dims else None


class PoolingEngine(LLMEngine):
    """Embeddings over the paged KV cache of one model, batched as a generating engine batches prompts."""

    def __init__(self, args=None, loaded=None, progress: bool = True):
        super().__init__(args, loaded, progress)
        assert self.pooler_config is not None, "PoolingEngine needs runner 'pooling'"
        self.matryoshka, self.matryoshka_dims = matryoshka_dimensions(self.model.path)
        config = model_config(self.model.path, self.args.hf_overrides)
        arch = classification_architecture(config)
        self.classifier = (read_classifier(self.model.path, config, self.hidden_size, self.tokenizer) if arch
                           else None)
        """A sequence classification model's head (None: an embedding model)."""
        if self.classifier is not None:
            logger.info("classification model (%s): %d labels (%s), %s", arch, self.classifier.num_labels,
                        ", ".join(self.classifier.labels), self.classifier.activation)
        else:
            logger.info("embedding model: %s pooling, %s, %d dimensions", self.pooler_config.pooling_type,
                        "normalized" if self.pooler_config.normalize else "not normalized", self.hidden_size)

    @property
    def hidden_size(self) -> int:
        """The embedding's length (before any `dimensions` cut)."""
        return self.model.config.hidden_size

    def add_request(self, request_id: str, prompt: str | list[int], params: PoolingParams | None = None, *,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue an embedding request; raises ValueError (naming the problem) if it can never run.
        A text prompt is tokenized with the model's special tokens (as embedding models are trained)."""
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise ValueError("this engine runs an embedding model (--runner pooling): it computes embeddings, not "
                             f"generations; pass PoolingParams, not {type(params).__name__}")
        self.memory.check_serving()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_task(params)
        ids = self.tokenize_prompt(prompt, add_special_tokens=True)
        if not ids:
            raise ValueError("the input has no tokens")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if keep > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens {keep} exceeds the model's maximum context length "
                                 f"{self.max_model_len}")
            ids = ids[-keep:]
        if len(ids) > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                             f"input has {len(ids)} tokens. Shorten it, or set truncate_prompt_tokens.")
        self._check_dimensions(params.dimensions)
        pc = self.pooler_config
        now = arrival_time if arrival_time is not None else time.time()
        group = PoolingGroup(request_id, prompt if isinstance(prompt, str) else None, ids,
                             PooledSequence(params, pc.pooling_type, pc.normalize), RequestMetrics(now),
                             self.classifier, params.activation is not False)
        self.scheduler.add_request(Request(request_id=request_id, prompt_token_ids=ids, max_tokens=1,
                                           sampling_params=params, priority=priority, arrival_time=now,
                                           cache_salt=prompt_cache_salt(self.long_rope_context, len(ids), cache_salt),
                                           read_prefix_cache=pc.pooling_type == "LAST",
                                           pooling=True))
        self._groups[request_id] = group
        self._seq_group[request_id] = group
        self.prompt_tokens += len(ids)
        if self.trace is not None:
            self.trace(request_id, "L4", "queued", {"prompt_tokens": len(ids), "pooling": pc.pooling_type,
                                                     "waiting": self.scheduler.num_waiting})

    def _check_task(self, params: PoolingParams) -> None:
        head, name = self.classifier, self.model.name
        if head is None:
            if params.task == "classify" or params.activation is not None:
                raise ValueError(f"model {name!r} is an embedding model, not a sequence classification model: it "
                                 "has no labels to classify into")
            return
        if params.task == "embed":
            raise ValueError(f"model {name!r} is a sequence classification model ({head.num_labels} labels: "
                             f"{', '.join(head.labels)}): it classifies, it does not embed (use classify)")
        for field in ("dimensions", "normalize"):
            if getattr(params, field) is not None:
                raise ValueError(f"{field} applies to embeddings; model {name!r} is a sequence classification model")

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if not self.matryoshka:
            raise ValueError(f"model {self.model.name!r} does not support Matryoshka representations, so its "
                             "embeddings cannot be cut to other dimensions (its config.json declares neither "
                             "is_matryoshka nor matryoshka_dimensions)")
        if dimensions > self.hidden_size:
            raise ValueError(f"dimensions {dimensions} exceeds the model's embedding size {self.hidden_size}")
        if self.matryoshka_dims and dimensions not in self.matryoshka_dims:
            raise ValueError(f"dimensions {dimensions} is not one the model was trained for: "
                             f"{', '.join(map(str, self.matryoshka_dims))}")

    def abort_request(self, request_id: str) -> EmbeddingRequestOutput | ClassificationRequestOutput | None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        self.scheduler.abort(request_id)
        self._seq_group.pop(request_id, None)
        group.finished = True
        group.metrics.finished_time = time.time()
        return group.output()

    def step(self) -> list[EmbeddingRequestOutput | ClassificationRequestOutput]:
        """One step: the scheduled prompt chunks through the model; returns the requests it finished."""
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted_ids)
        if plan.is_empty:
            return []
        now = time.time()
        for s in plan.scheduled:
            group = self._groups[s.request_id]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        inputs, _ = mixed_inputs(plan.scheduled, self.runner.cfg, long_prompts=long_prompts(
            plan.scheduled, self.scheduler.get_request, self.long_rope_context))
        rows = np.asarray(self.runner.fetch(self.runner.dispatch_pool(inputs)))
        for i, s in enumerate(plan.scheduled):
            self._groups[s.request_id].pooled.take(rows[i], s.start_position, s.num_new_tokens, s.sample)
        outputs, now = [], time.time()
        for request in self.scheduler.update_after_step(plan, {}, ()):
            group = self._groups.pop(request.request_id)
            self._seq_group.pop(request.request_id, None)
            group.finish()
            group.metrics.first_token_time = group.metrics.finished_time = now
            group.metrics.num_cached_tokens = request.num_cached_tokens
            if self.trace is not None:
                self.trace(group.request_id, "L4", "finished", {"cached_tokens": request.num_cached_tokens,
                                                                "dimensions": len(group.result)})
            outputs.append(group.output())
        return outputs
