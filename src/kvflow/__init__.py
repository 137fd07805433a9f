"""kvflow: an LLM inference engine with a paged KV cache and continuous batching."""

from kvflow.config import EngineArgs
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvflow.entrypoints.llm import LLM
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "LLMEngine", "AsyncLLM", "EngineArgs", "SamplingParams", "RequestOutputKind",
    "RequestOutput", "CompletionOutput", "Logprob", "StructuredOutputsParams", "LoRARequest",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
]
__version__ = "0.1.0"
