"""Embeddings: how a pooling engine turns a prompt's hidden states into one vector, and what a request asks.

An engine runs one of two runners (vLLM's names): ``generate`` samples tokens; ``pooling`` computes each
prompt once and returns, instead of tokens, the final-normed hidden states pooled into one vector. How
they are pooled is the model directory's word: sentence-transformers' ``modules.json`` with its Pooling
module (``1_Pooling/config.json``: the last token's state, the mean of them all, or the first token's) and
an optional Normalize module. A directory without those files pools the last token and normalizes, as
vLLM does for decoder models (e5-mistral, gte-Qwen2, Qwen3-Embedding all pool the last token).

A sequence classifier (``Qwen2ForSequenceClassification``: a ``score`` head of one row per label over the
last token's state) is a pooling model too: its output is the head's logits through an activation, sigmoid
for one label (a cross-encoder reranker's relevance) and softmax across more, none for a regressor, or
the one its sentence-transformers cross-encoder config names. A request's ``task`` says which output it wants:
``embed`` from an embedding model, ``classify`` from a classifier; each model refuses the other.

``resolve_runner("auto", dir)`` picks ``pooling`` for a directory that is a sentence-transformers model or
whose architectures are bare models (``Qwen3Model``, ``MistralModel``: no language-model head) or
sequence classifiers, else ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from shared.json_file import read_json
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_internal_pb2 as wire
from shared.sampling_params import keep_last_tokens

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("embed", "classify")
ACTIVATIONS = ("sigmoid", "softmax", "identity")
CLASSIFIER_SUFFIX = "ForSequenceClassification"
# A sentence-transformers cross-encoder's activation_fn (config.json) -> ours.
_CROSS_ENCODER_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                              "torch.nn.modules.linear.Identity": "identity"}
MODULES_FILE = "modules.json"
# sentence-transformers' Pooling config: the switch that selects each mode we pool by.
_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_TYPE = "sentence_transformers.models."


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How the model's hidden states become its embedding (read from the model directory)."""

    pooling_type: str  # "last": the last token's state; "mean": the mean over the prompt; "cls": the first token's
    normalize: bool  # L2-normalized, unless a request says otherwise
    hidden_size: int  # the embedding's length, before a request's ``dimensions`` cut it
    matryoshka: bool = False  # trained so that its first k values are an embedding too (a request may cut it)
    matryoshka_dimensions: tuple[int, ...] = ()  # the lengths it was trained for; empty: any up to hidden_size
    max_seq_length: int | None = None  # sentence-transformers' own limit on the prompt, when it sets one
    lowercase: bool = False  # sentence-transformers' do_lower_case: the front ends lowercase texts before tokenizing
    labels: tuple[str, ...] = ()  # a classifier's class names in logit order (id2label); empty: an embedding model
    activation: str | None = None  # a classifier's, on its logits: one of ACTIVATIONS

    def __post_init__(self) -> None:
        if self.labels and (self.activation not in ACTIVATIONS or self.pooling_type != "last"):
            raise ValueError(f"a classifier pools the last token and has an activation in {ACTIVATIONS}, got "
                             f"{self.pooling_type!r} and {self.activation!r}")
        if not self.labels and self.activation is not None:
            raise ValueError("only a classifier (with labels) has an activation")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if not isinstance(self.hidden_size, int) or self.hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive integer, got {self.hidden_size!r}")
        bad = [d for d in self.matryoshka_dimensions if not 0 < d <= self.hidden_size]
        if bad:
            raise ValueError(f"matryoshka_dimensions {list(self.matryoshka_dimensions)} must lie in "
                             f"[1, {self.hidden_size}]")

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt token's state is pooled (mean) or the first one's (cls): then a prompt is
        computed from its start, with no prefix-cache hit (the cached tokens' states are not kept)."""
        return self.pooling_type != "last"

    @property
    def classifies(self) -> bool:
        return bool(self.labels)

    @property
    def task(self) -> str:
        """What it serves: "classify" (class scores), or "embed"."""
        return "classify" if self.classifies else "embed"

    def to_proto(self) -> wire.PoolerInfo:
        return wire.PoolerInfo(pooling_type=self.pooling_type, normalize=self.normalize,
                               hidden_size=self.hidden_size, matryoshka=self.matryoshka,
                               matryoshka_dimensions=self.matryoshka_dimensions,
                               max_seq_length=self.max_seq_length or 0, lowercase=self.lowercase,
                               labels=self.labels, activation=self.activation or "")

    @classmethod
    def from_proto(cls, m: wire.PoolerInfo) -> "PoolerConfig":
        return cls(m.pooling_type, m.normalize, m.hidden_size, m.matryoshka, tuple(m.matryoshka_dimensions),
                   m.max_seq_length or None, m.lowercase, tuple(m.labels), m.activation or None)

    def text(self, text: str) -> str:
        """A text input as the model's tokenizer is to see it."""
        return text.lower() if self.lowercase else text


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What one pooling request asks of the pooler (vLLM's PoolingParams, OpenAI's embeddings fields)."""

    dimensions: int | None = None  # embed: keep the first this many values (matryoshka models only), then normalize
    normalize: bool | None = None  # embed: None: as the model says (PoolerConfig.normalize)
    # Keep only the prompt's last k tokens (-1: as many as the context holds); applied where prompts are
    # tokenized (the front ends), so it does not travel to the engine.
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None  # classify: False gives the raw logits; None or True: the model's activation
    # "embed" (an embedding model's vector) or "classify" (a classifier's class scores); None, as in vLLM:
    # the entry point's (LLM.embed, LLM.classify, the gateway's endpoints), set through with_task.
    task: str | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"PoolingParams.task must be one of {TASKS}, got {self.task!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"PoolingParams.use_activation must be true, false or null, got {self.use_activation!r}")
        wrong = {"classify": ("dimensions", "normalize"), "embed": ("use_activation",)}.get(self.task, ())
        for name in wrong:
            if getattr(self, name) is not None:
                raise ValueError(f"PoolingParams.{name} does not apply to the {self.task} task")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize must be true, false or null, got {self.normalize!r}")
        _check_truncation(self.truncate_prompt_tokens)

    def with_task(self, task: str) -> "PoolingParams":
        """These params for ``task`` (ValueError if they name another, or fields it does not take)."""
        if self.task not in (None, task):
            raise ValueError(f"PoolingParams.task is {self.task!r}, but this asks for {task!r}")
        return self if self.task == task else replace(self, task=task)

    def truncated(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the engine takes it (its last truncate_prompt_tokens tokens)."""
        token_limit(self.truncate_prompt_tokens, max_model_len)  # ValueError past the context
        return keep_last_tokens(prompt_token_ids, self.truncate_prompt_tokens, max_model_len)

    def check_fits(self, pooler: PoolerConfig) -> None:
        """ValueError unless the model can give what is asked (no task: the model's)."""
        if self.task is None:
            return self.with_task(pooler.task).check_fits(pooler)
        if self.task != pooler.task:
            raise ValueError(f"this model is {'a classifier' if pooler.classifies else 'an embedding model'}: it "
                             f"serves the {pooler.task} task, not {self.task} ("
                             + ("class scores from /classify, /score and LLM.classify" if pooler.classifies else
                                "embeddings from /v1/embeddings and LLM.embed") + ")")
        if self.dimensions is None or self.dimensions == pooler.hidden_size:
            return
        if not pooler.matryoshka:
            raise ValueError(f"PoolingParams.dimensions={self.dimensions} was asked for, but this model does not "
                             "support matryoshka representation (its config.json says neither is_matryoshka nor "
                             "matryoshka_dimensions): cutting its embeddings would make them poor")
        if self.dimensions > pooler.hidden_size:
            raise ValueError(f"PoolingParams.dimensions={self.dimensions} exceeds the embedding size "
                             f"{pooler.hidden_size}")
        if pooler.matryoshka_dimensions and self.dimensions not in pooler.matryoshka_dimensions:
            raise ValueError(f"PoolingParams.dimensions={self.dimensions} is not one the model was trained for: "
                             f"{', '.join(map(str, pooler.matryoshka_dimensions))}")

    def to_proto(self) -> api.PoolingParameters:
        m = api.PoolingParameters()
        if self.dimensions is not None:
            m.dimensions = self.dimensions
        if self.normalize is not None:
            m.normalize = self.normalize
        if self.use_activation is not None:
            m.use_activation = self.use_activation
        m.task = self.task or ""
        return m

    @classmethod
    def from_proto(cls, m: api.PoolingParameters) -> "PoolingParams":
        return cls(m.dimensions if m.HasField("dimensions") else None,
                   m.normalize if m.HasField("normalize") else None, None,
                   m.use_activation if m.HasField("use_activation") else None, m.task or None)


def resolve_runner(runner: str, model_dir: Path) -> str:
    """``generate`` or ``pooling``: as asked, or for ``auto`` as the directory looks (module docstring)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    config = read_json(model_dir / "config.json")
    if runner == "generate" and is_classifier(config):
        names = ", ".join(map(str, config["architectures"]))
        raise ValueError(f"{model_dir / 'config.json'}: a sequence classifier ({names}) has no language-model head "
                         "to generate with; serve it with runner 'pooling' (or 'auto')")
    if runner != "auto":
        return runner
    if (model_dir / MODULES_FILE).is_file():
        return "pooling"
    architectures = config.get("architectures") or []
    bare = architectures and all(isinstance(a, str) and a.endswith(("Model", CLASSIFIER_SUFFIX))
                                 and not a.endswith("LMHeadModel") for a in architectures)  # (GPT-2's is a LM)
    return "pooling" if bare else "generate"


def read_pooler_config(model_dir: Path, hidden_size: int) -> PoolerConfig:
    """The directory's pooler (module docstring); ValueError naming the file for what cannot be honoured."""
    model_dir = Path(model_dir)
    config = read_json(model_dir / "config.json")
    dimensions, flag = config.get("matryoshka_dimensions") or [], config.get("is_matryoshka", False)
    if not isinstance(dimensions, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dimensions):
        raise ValueError(f"{model_dir / 'config.json'}: matryoshka_dimensions must be a list of integers, "
                         f"got {dimensions!r}")
    if not isinstance(flag, bool):
        raise ValueError(f"{model_dir / 'config.json'}: is_matryoshka must be true or false, got {flag!r}")
    matryoshka_dimensions = tuple(dimensions)
    matryoshka = flag or bool(matryoshka_dimensions)
    if is_classifier(config):
        return _classifier(config, model_dir / "config.json", hidden_size)
    modules_file = model_dir / MODULES_FILE
    if not modules_file.is_file():
        return PoolerConfig("last", True, hidden_size, matryoshka, matryoshka_dimensions)
    modules = read_json(modules_file, list)
    pooling_type, normalize, max_seq_length, lowercase = None, False, None, False
    for module in modules:
        kind = module.get("type", "") if isinstance(module, dict) else ""
        path = model_dir / str(module.get("path", "")) if isinstance(module, dict) else model_dir
        if kind == _ST_TYPE + "Transformer":
            if path.resolve() != model_dir.resolve():
                raise ValueError(f"{modules_file}: the Transformer module must be the directory itself, not {path}")
            bert_config = read_json(model_dir / "sentence_bert_config.json", optional=True)
            max_seq_length, lowercase = bert_config.get("max_seq_length"), bert_config.get("do_lower_case", False)
        elif kind == _ST_TYPE + "Pooling":
            if path.resolve() == model_dir.resolve():
                raise ValueError(f"{modules_file}: the Pooling module needs the path of its own directory")
            pooling_type = _pooling_type(path / "config.json", hidden_size)
        elif kind == _ST_TYPE + "Normalize":
            normalize = True
        else:
            raise ValueError(f"{modules_file}: module {module!r:.120} is not supported (only Transformer, Pooling "
                             "and Normalize: a Dense projection or another module would change the embeddings)")
    if pooling_type is None:
        raise ValueError(f"{modules_file} lists no Pooling module: the embedding's pooling is unknown")
    if max_seq_length is not None and (not isinstance(max_seq_length, int) or max_seq_length < 1):
        raise ValueError(f"{model_dir / 'sentence_bert_config.json'}: max_seq_length must be a positive integer")
    if not isinstance(lowercase, bool):
        raise ValueError(f"{model_dir / 'sentence_bert_config.json'}: do_lower_case must be true or false")
    return PoolerConfig(pooling_type, normalize, hidden_size, matryoshka, matryoshka_dimensions, max_seq_length,
                        lowercase)


def is_classifier(config: dict) -> bool:
    """Whether a config.json is a sequence classifier's (a score head instead of the language-model head)."""
    return any(isinstance(a, str) and a.endswith(CLASSIFIER_SUFFIX) for a in config.get("architectures") or [])


def _classifier(config: dict, file: Path, hidden_size: int) -> PoolerConfig:
    """As transformers' *ForSequenceClassification: the head over the last token's state (module docstring)."""
    id2label, count = config.get("id2label"), config.get("num_labels")
    if id2label is None:  # transformers' default: num_labels (2) labels named LABEL_i
        id2label = {str(i): f"LABEL_{i}" for i in range(2 if count is None else count)}
    if not isinstance(id2label, dict) or sorted(id2label) != sorted(str(i) for i in range(len(id2label))) \
            or not all(isinstance(v, str) for v in id2label.values()):
        raise ValueError(f"{file}: id2label must map 0..n-1 to label names, got {id2label!r:.200}")
    if not id2label or (count is not None and count != len(id2label)):
        raise ValueError(f"{file}: num_labels {count} and id2label's {len(id2label)} labels disagree (or none)")
    labels = tuple(id2label[str(i)] for i in range(len(id2label)))
    # sentence-transformers' cross-encoder names its activation (older versions in a key of their own).
    named = (config.get("sentence_transformers") or {}).get("activation_fn") or \
        config.get("sbert_ce_default_activation_function")
    if named is not None:
        if named not in _CROSS_ENCODER_ACTIVATIONS:
            raise ValueError(f"{file}: sentence_transformers.activation_fn {named!r} is not supported (only "
                             f"{', '.join(_CROSS_ENCODER_ACTIVATIONS)})")
        activation = _CROSS_ENCODER_ACTIVATIONS[named]
    elif config.get("problem_type") == "regression":
        activation = "identity"  # a score on a scale (an STS regressor), not a probability
    elif len(labels) == 1 or config.get("problem_type") == "multi_label_classification":
        activation = "sigmoid"  # each label on its own
    else:
        activation = "softmax"
    return PoolerConfig("last", False, hidden_size, labels=labels, activation=activation)


def _pooling_type(file: Path, hidden_size: int) -> str:
    raw = read_json(file)
    chosen = [mode for key, mode in _POOLING_MODES.items() if raw.get(key)]
    others = [key for key in _OTHER_MODES if raw.get(key)]
    if others or len(chosen) != 1:
        raise ValueError(f"{file}: exactly one of {', '.join(_POOLING_MODES)} must be on (got "
                         f"{', '.join(chosen + others) or 'none'}); other pooling modes are not supported")
    if raw.get("include_prompt", True) is False:
        raise ValueError(f"{file}: include_prompt false (pooling without the instruction's tokens) is not supported")
    width = raw.get("word_embedding_dimension", hidden_size)
    if width != hidden_size:
        raise ValueError(f"{file}: word_embedding_dimension {width} differs from the model's hidden_size {hidden_size}")
    return chosen[0]




def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> tuple[list[str], list[str]]:
    """The pairs a score request compares (vLLM's rule): one text_1 against every text_2, or pair by pair."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second or not all(isinstance(t, str) for t in first + second):
        raise ValueError("text_1 and text_2 must each be a text or a non-empty list of texts")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as "
                         "text_2")
    return first, second


def check_cross_encoder(pooler: PoolerConfig) -> None:
    """ValueError unless a classifier can score text pairs: as in vLLM, only one with a single label (a
    cross-encoder, whose one score is the pair's relevance)."""
    if len(pooler.labels) != 1:
        raise ValueError(f"scoring pairs takes a classifier with one label (a cross-encoder); this one has "
                         f"{len(pooler.labels)} ({', '.join(pooler.labels)}): classify the texts instead")


def token_limit(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """The most tokens a prompt keeps (None: all). A cross-encoder's pair is cut by the tokenizer, which
    trims the longer text to fit, as vLLM truncates pairs (keeping the last tokens would cut the query)."""
    k = truncate_prompt_tokens
    _check_truncation(k)
    if k is None:
        return None
    if k > max_model_len:
        raise ValueError(f"PoolingParams.truncate_prompt_tokens ({k}) exceeds the context length "
                         f"({max_model_len}); use -1 for as many tokens as the context holds")
    return max_model_len if k == -1 else k


def _check_truncation(k) -> None:
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k >= 1 or k == -1)):
        raise ValueError(f"PoolingParams.truncate_prompt_tokens must be an integer >= 1, or -1 (the context "
                         f"length), got {k!r}")
