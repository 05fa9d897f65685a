"""Structured outputs, host side (numpy and llguidance; no jax): the request's constraint
(`StructuredOutputsParams`), its grammar compiled once per text (`GrammarCompiler`), each
request's matcher (`GrammarMatcher`) that fills its row of the step's token bitmask, and the
bitmask layout (`bitmask`). docs/structured_outputs.md describes how the engine uses them.

The grammar engine is imported on first use of the compiler or matcher, so that constructing
`StructuredOutputsParams` (the LLM API, the server's request parsing) does not load it.
"""

from jaxmamba.structured.bitmask import apply_bitmask_ref, bitmask_words, unpack_bitmask
from jaxmamba.structured.params import StructuredOutputsParams

__all__ = [
    "StructuredOutputsParams",
    "GrammarCompiler",
    "CompiledGrammar",
    "GrammarMatcher",
    "GrammarVocab",
    "fill_bitmasks",
    "validate",
    "apply_bitmask_ref",
    "bitmask_words",
    "unpack_bitmask",
]

_LAZY = {
    "GrammarCompiler": "grammar",
    "CompiledGrammar": "grammar",
    "GrammarVocab": "grammar",
    "validate": "grammar",
    "GrammarMatcher": "matcher",
    "fill_bitmasks": "matcher",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"jaxmamba.structured.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jaxmamba.structured' has no attribute {name!r}")
