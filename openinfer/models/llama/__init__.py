"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3 (`model.py`), from HF directories and GGUF files."""

from openinfer.models.llama.family import FAMILY

__all__ = ["FAMILY"]
