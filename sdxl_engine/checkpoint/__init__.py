"""Files -> a LoadedModel, nothing traced: diffusers folders, hub ids and the built-in models
(loading.py), the weight files and their key rules (weights.py), the built-ins and their
tokenizer vocabulary (builtin.py), SDXL 1.0 base's config files (configs/)."""
