"""chatengine: a paged-KV LLM serving engine for multi-user chat."""
from chatengine.config import EngineConfig
from chatengine.engine import LLM, AsyncLLM, LLMEngine
from chatengine.outputs import CompletionOutput, RequestOutput
from chatengine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig"]
