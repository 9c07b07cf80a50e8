"""The DeepSeek-V4.1 family: `model.py` (the model), `config.py` (DeepSeek's config and its schedule rules),
`loader.py` (the published layout, loading), `writer.py` (random checkpoints in that layout), `family.py`."""

from openinfer.models.deepseek_v41.family import FAMILY

__all__ = ["FAMILY"]
