"""jaxserve: an LLM serving engine written in JAX."""

from jaxserve.beam_search import BeamSearchParams
from jaxserve.engine_args import EngineArgs
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolerConfig, PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncEngine", "EngineArgs", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "LoRARequest", "PoolingParams", "PoolerConfig", "EmbeddingRequestOutput",
           "EmbeddingOutput"]


def __getattr__(name: str):
    # The engine classes pull in JAX; import them on first use only.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from jaxserve.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
