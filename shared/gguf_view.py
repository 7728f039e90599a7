"""A GGUF file (llama.cpp's single-file checkpoint) as the model directory every service reads: config.json
from the file's metadata (transformers' own reading of it, with the head size and Llama 3's rope scaling it
leaves out), the tokenizer's files beside it, and the file linked as model.gguf, whose tensors the worker's
loader dequantizes (services/worker/quantization/gguf_checkpoint.py).

As vLLM recommends, the tokenizer is the original model's (--tokenizer, a directory or Hub id): GGUF's own
tokenizer metadata is not read. The directory is made once per file and tokenizer under the cache, in a
private folder renamed into place, so concurrent starts see none or a whole one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from shared.cache_dir import cache_root, made_once
from shared.gguf_rope import llama3_rope_scaling

GGUF_FILE = "model.gguf"
ROPE_FREQS = "rope_freqs.weight"  # read into config.json, not loaded as a weight
VIEW_VERSION = 2  # 2: config.json carries rope_freqs as rope_scaling
# What a tokenizer folder holds besides weights (the original model's config.json is replaced by the file's).
_TOKENIZER_FILES = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")


def names_a_gguf_file(name: str | None) -> bool:
    return bool(name) and str(name).endswith(".gguf")


def gguf_model_dir(file: str | Path, tokenizer: str | Path | None) -> Path:
    """The model directory standing for ``file``, with ``tokenizer``'s files (a local folder)."""
    file = Path(file).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {file} does not exist")
    if tokenizer is None:
        raise ValueError(f"{file}: a GGUF model needs --tokenizer, the tokenizer of the model it was converted "
                         "from (a directory or Hub id)")
    tokenizer = Path(tokenizer).resolve()
    return made_once(cache_root() / "gguf" / f"{file.stem}-{_key(file, tokenizer)}",
                     lambda folder: _fill(folder, file, tokenizer))


def _key(file: Path, tokenizer: Path) -> str:
    """Changes when the file is replaced, another tokenizer is given, or what config.json is made of changes
    (VIEW_VERSION: a folder made before Llama 3's rope scaling was read would serve without it)."""
    stat = file.stat()
    text = f"{VIEW_VERSION}|{file}|{stat.st_size}|{stat.st_mtime_ns}|{tokenizer}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _fill(folder: Path, file: Path, tokenizer: Path) -> None:
    for pattern in _TOKENIZER_FILES:
        for source in tokenizer.glob(pattern):
            if source.name != "config.json" and source.is_file():
                shutil.copy2(source, folder / source.name)
    (folder / "config.json").write_text(json.dumps(gguf_config(file), indent=2) + "\n")
    (folder / GGUF_FILE).symlink_to(file)


def gguf_config(file: Path) -> dict:
    """config.json's fields for the GGUF file, as transformers reads its metadata."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = load_gguf_checkpoint(str(file), return_tensors=False)["config"]
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{file}: cannot read its GGUF metadata: {str(exc).splitlines()[0]}") from None
    from gguf import GGUFReader

    reader = GGUFReader(str(file))
    config = {**config, **_head_dim(reader, config)}
    try:
        config.update(_rope_scaling(reader, config))
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None
    return {**config, "architectures": [_architecture(config.get("model_type", ""))]}


def _head_dim(reader, config: dict) -> dict:
    """The file's key length as head_dim: transformers maps it for some architectures only (not Qwen3's,
    whose config would then take its class default of 128)."""
    field = reader.get_field(f"{config.get('model_type')}.attention.key_length")
    return {} if field is None else {"head_dim": int(field.contents())}


def _rope_scaling(reader, config: dict) -> dict:
    """Llama 3's rope scaling, which llama.cpp stores as the ``rope_freqs`` tensor (transformers' reading
    drops it), as config.json's ``rope_scaling`` (shared/gguf_rope.py)."""
    from gguf import dequantize

    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return {}
    arch = config.get("model_type")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary = reader.get_field(f"{arch}.rope.dimension_count")
    original = reader.get_field(f"{arch}.rope.scaling.original_context_length")
    scaling = llama3_rope_scaling(dequantize(tensor.data, tensor.tensor_type),
                                  float(config.get("rope_theta", 10000.0)),
                                  int(rotary.contents()) if rotary is not None else head_dim,
                                  int(original.contents()) if original is not None else 8192)
    return {} if scaling is None else {"rope_scaling": scaling}


def _architecture(model_type: str) -> str:
    """transformers' causal-LM class name for the model type (qwen2 -> Qwen2ForCausalLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, f"{model_type}ForCausalLM")
