"""Serving engine: requests, continuous-batching scheduler, paged model runner, sampling, LLM API."""

from hybridkv.engine.core import EngineConfig, EngineCore, Event  # noqa: F401
from hybridkv.engine.llm import LLM, RequestOutput  # noqa: F401
from hybridkv.engine.sampling import SamplingParams  # noqa: F401
