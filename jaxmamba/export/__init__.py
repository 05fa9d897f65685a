"""Exported serving artifacts (`jaxmamba export`), deviceless AOT compiles (`jaxmamba aot`)
and the persistent compilation cache. Nothing is imported here: the modules are loaded on use
(`jaxmamba.export.artifact` and `.serving` never import the model code)."""
