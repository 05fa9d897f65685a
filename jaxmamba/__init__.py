"""jaxmamba: a JAX/XLA serving engine for Mamba2 hybrid language models."""

from jaxmamba.config import ModelConfig
from jaxmamba.llm import LLM, CompletionOutput, RequestOutput
from jaxmamba.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "ModelConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
