"""The DeepSeek-V4 family: `model.py` (the model), `config.py`, `loader.py` (checkpoint names, formats, loading),
`writer.py` (random checkpoints in the published layout), `family.py` (what the registry asks)."""

from openinfer.models.deepseek_v4.family import FAMILY

__all__ = ["FAMILY"]
