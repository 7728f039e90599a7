"""Where the gateway reads the served model's tokenizer and sampling defaults: the folder the scheduler
reports (the worker's model, on this machine as `pagedserve serve` runs it), or --tokenizer (a folder or a
Hub id, at --tokenizer-revision) where the gateway runs elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.generation_defaults import GenerationDefaults, read_generation_defaults
from shared.hub import local_or_hub


@dataclass(frozen=True)
class ModelFiles:
    tokenizer: str | None = None  # --tokenizer (None: the model's folder)
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    generation_config: str = "auto"  # --generation-config
    override_generation_config: str | None = None  # its JSON

    def tokenizer_dir(self, model_path: str) -> Path:
        if self.tokenizer is None:
            return Path(model_path)
        return local_or_hub(self.tokenizer, revision=self.tokenizer_revision, download_dir=self.download_dir,
                            weights=False)

    def generation_defaults(self, model_path: str, tokenizer_dir: Path) -> GenerationDefaults:
        """From the model's folder where this machine has it, else from the tokenizer's (its repository's)."""
        folder = Path(model_path) if Path(model_path).is_dir() else tokenizer_dir
        return read_generation_defaults(self.generation_config, folder, self.override_generation_config)
