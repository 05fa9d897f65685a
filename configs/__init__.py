"""Model presets, shipped as package data (`jaxmamba.configs`): a preset is `<name>.yaml`
(a ModelConfig; random weights from a seed) or a directory `<name>/` holding an HF checkpoint
(config.json, safetensors weights, tokenizer.json)."""
