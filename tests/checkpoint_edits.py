"""Edits to a copied test model's checkpoint, for the loader's error tests."""

from __future__ import annotations


def rewrite_weights(model_dir, edit) -> None:
    """Apply ``edit`` to the dict of model.safetensors' tensors and write the file back."""
    from safetensors.torch import load_file, save_file

    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
