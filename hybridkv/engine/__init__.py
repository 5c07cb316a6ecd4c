"""Serving engine: requests, continuous-batching scheduler, paged model runner, sampling, LLM API."""

from hybridkv.engine.config import EngineConfig, resolve_dtype  # noqa: F401
from hybridkv.engine.core import EngineCore, Event  # noqa: F401
from hybridkv.engine.llm import LLM, RequestOutput  # noqa: F401
from hybridkv.engine.sampling import SamplingParams  # noqa: F401
