"""Speculative decoding (issue 12; spec 000 §6, DeepInfer's DSpark): drafters propose tokens, one target forward
verifies them, the sampler's own draws decide what is accepted (docs/spec_decode.md)."""
