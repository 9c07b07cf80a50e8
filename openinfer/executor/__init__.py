"""Executors: how an engine's ranks are started, watched and stopped. One rank runs in the caller's process (an
`LLMEngine`); several run as one worker process each behind `MultiprocEngine` (`multiproc.py`, `worker.py`), or, with
`distributed_executor_backend="ray"`, as one Ray actor each behind the same front end (`ray_ranks.py`)."""

from openinfer.config import EngineConfig


def make_engine(config: EngineConfig):
    """The one-process `LLMEngine`, or the multi-process front end when the config asks for several ranks."""
    if config.world_size > 1:
        from openinfer.executor.multiproc import MultiprocEngine

        return MultiprocEngine(config)
    from openinfer.engine.llm_engine import LLMEngine

    return LLMEngine(config)
