"""The Gemma-3 family (text; a multimodal checkpoint loads its text tower): `model.py`."""

from openinfer.models.gemma3.family import FAMILY

__all__ = ["FAMILY"]
