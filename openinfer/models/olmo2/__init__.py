"""The OLMo-2 family (AllenAI's `Olmo2ForCausalLM`): `model.py`, `family.py`. Added as docs/architecture.md's
walk-through shows: this package and one line in models/registry.py."""

from openinfer.models.olmo2.family import FAMILY

__all__ = ["FAMILY"]
