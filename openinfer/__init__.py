"""openinfer: the DeepInfer inference-engine design as open, portable Python."""

from openinfer.config import EngineConfig
from openinfer.entrypoints.llm import LLM
from openinfer.outputs import CompletionOutput, Logprob, RequestOutput
from openinfer.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig",
           "RequestOutputKind"]
__version__ = "0.1.0"
