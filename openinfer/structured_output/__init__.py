"""Structured output: grammar compilation off the critical path (`compiler.py`), per-request matcher state
and the step's token bitmask (`manager.py`), the request-side spec (`params.py`). docs/structured_output.md."""

from openinfer.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
