"""Embedding model directories for the tests: a tiny generative model saved as transformers' bare model
(no ``model.`` prefix, no head) with sentence-transformers' files, and the transformers oracle for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ST = "sentence_transformers.models."


def make_embedding_dir(source: Path, path: Path, pooling: str = "lasttoken", normalize: bool = True,
                       sentence_transformers: bool = True, **config_changes) -> Path:
    """``source``'s weights as a bare model (``Qwen3Model``...) in ``path``; with ``sentence_transformers``
    its modules.json, a Pooling module of that mode and (``normalize``) a Normalize module."""
    path.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            shutil.copy(file, path / file.name)
    weights = load_file(str(source / "model.safetensors"))
    bare = {name.removeprefix("model."): tensor for name, tensor in weights.items() if name != "lm_head.weight"}
    save_file(bare, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [config["architectures"][0].replace("ForCausalLM", "Model")]
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if sentence_transformers:
        modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir(exist_ok=True)
        modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens",
                                                              "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": config["hidden_size"], "include_prompt": True, **modes}))
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    return path


def hf_embedding(model_dir: Path, token_ids: list[int], pooling: str = "lasttoken", normalize: bool = True,
                 dimensions: int | None = None) -> torch.Tensor:
    """transformers' bare model's final hidden states, pooled as sentence-transformers pools them."""

    model = _bare_model(str(model_dir))
    with torch.no_grad():
        states = model(torch.tensor([token_ids])).last_hidden_state[0].float()
    vector = {"lasttoken": states[-1], "mean_tokens": states.mean(dim=0), "cls_token": states[0]}[pooling]
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


_models: dict[str, object] = {}


def _bare_model(model_dir: str):
    from transformers import AutoModel

    if model_dir not in _models:
        _models[model_dir] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _models[model_dir]


def make_classifier_dir(source: Path, path: Path, labels: tuple[str, ...] = ("negative", "positive"),
                        seed: int = 0, **config_changes) -> Path:
    """``source``'s weights as transformers' ``*ForSequenceClassification`` in ``path``: no lm_head, a fresh
    ``score`` head of one row per label (sharp: the scores spread, so a wrong row shows)."""
    path.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            shutil.copy(file, path / file.name)
    weights = {name: t for name, t in load_file(str(source / "model.safetensors")).items() if name != "lm_head.weight"}
    hidden = weights["model.embed_tokens.weight"].shape[1]
    generator = torch.Generator().manual_seed(seed)
    weights["score.weight"] = torch.randn(len(labels), hidden, generator=generator) * (2.0 / hidden ** 0.5)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
    config["id2label"] = {str(i): label for i, label in enumerate(labels)}
    config["label2id"] = {label: i for i, label in enumerate(labels)}
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def hf_class_scores(model_dir: Path, token_ids: list[int], activation: str | None = "softmax",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' sequence classifier's logits for one prompt, through ``activation`` (None: raw)."""
    from transformers import AutoModelForSequenceClassification

    key = f"classifier:{model_dir}:{dtype}"
    if key not in _models:
        _models[key] = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.no_grad():
        logits = _models[key](torch.tensor([token_ids])).logits[0].float()
    return {"softmax": lambda x: torch.softmax(x, dim=0), "sigmoid": torch.sigmoid, None: lambda x: x}[activation](logits)
