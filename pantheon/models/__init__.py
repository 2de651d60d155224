"""Model files: what the router reads of a model folder or GGUF file, size estimates, the built-in random-weight presets and their tokenizer."""
