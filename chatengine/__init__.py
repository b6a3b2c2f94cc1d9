"""chatengine: a paged-KV LLM serving engine for multi-user chat. These names are the public API."""

from chatengine.config import EngineConfig
from chatengine.engine.async_llm import AsyncLLM
from chatengine.engine.llm import LLM
from chatengine.engine.llm_engine import LLMEngine
from chatengine.engine.replicas.data_parallel import DataParallelLLM
from chatengine.outputs import CompletionOutput, RequestOutput
from chatengine.sampling_params import SamplingParams, StructuredOutputs

__all__ = [
    "LLM",
    "AsyncLLM",
    "DataParallelLLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputs",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
]
