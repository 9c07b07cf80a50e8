"""The HTTP service around the engine: OpenAI / Anthropic protocols, streaming, metrics."""
