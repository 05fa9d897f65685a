"""jaxmamba: a JAX/XLA serving engine for hybrid language models with recurrent layers (Mamba2,
Gated DeltaNet)."""

import logging
from pathlib import Path

# Installed, `jaxmamba.kernels` and `jaxmamba.configs` are folders of this package (pyproject
# maps the checkout's kernels/ and configs/ there). Run from a checkout's root, this source
# folder shadows the install and lacks them, so the checkout root joins the package's search
# path: they then import from kernels/ and configs/ themselves, whatever the install.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (
    not (Path(__file__).parent / "kernels").exists()
    and (_CHECKOUT / "kernels/__init__.py").is_file()
):
    __path__.append(str(_CHECKOUT))

from jaxmamba.config import ModelConfig  # noqa: E402
from jaxmamba.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from jaxmamba.sampling_params import SamplingParams  # noqa: E402
from jaxmamba.structured.params import StructuredOutputsParams  # noqa: E402

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "ModelConfig",
    "RequestOutput",
    "CompletionOutput",
]
__version__ = "0.1.0"


def _not_the_tpu_probe(record: logging.LogRecord) -> bool:
    # On first use jax tries every backend it knows and logs, at INFO, that the TPU one failed
    # on a machine without one; where TPU chips are present jax still warns that it fell back.
    return not record.getMessage().startswith("Unable to initialize backend 'tpu'")


logging.getLogger("jax._src.xla_bridge").addFilter(_not_the_tpu_probe)


def __getattr__(name: str):
    # `LLM` is loaded on first use, so that the host side (scheduler, server, tokenizer) can
    # be imported without jax.
    if name == "LLM":
        from jaxmamba.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxmamba' has no attribute {name!r}")
