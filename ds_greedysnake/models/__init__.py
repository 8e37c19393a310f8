"""What the engine trains: a model split into layers (the built-in GPT, HF causal LMs), a micro-batch's inputs
and loss, the weights in and out (HF safetensors, ZeRO fp32). Imports storage/ and the base only."""
