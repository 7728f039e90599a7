"""The worker: the model, attention and kernels, sampling, LoRA, speculation, grammars, tensor parallel, its service."""
