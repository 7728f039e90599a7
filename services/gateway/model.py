"""The served model, as the scheduler reports it: its names and adapters, its tokenizer (prompts, chats and
embedding inputs to token ids, token ids to text) and the checks a request passes before it is submitted."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.gateway.deltas import TokenLogprob, TopToken
from services.gateway.image_prompts import ImagePrompts
from services.gateway.media import MediaOptions
from services.gateway.lora_modules import LoRAModule
from services.gateway.reasoning_parsers import ReasoningParser
from services.gateway.tool_parsers import ToolCallParser
from shared.generation_defaults import GenerationDefaults
from shared.grpc_errors import NotFound
from shared.invalid_parameter import InvalidParameter
from shared.lora import LoRARequest
from shared.pooling import PoolerConfig
from shared.request import EngineRequest, RequestLimits, check_token_ids, validate
from shared.tokenizer import render_chat


@dataclass(slots=True)
class Model:
    name: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    tokenizer: object
    max_num_seqs: int = 0  # per request (n, beams); 0: the scheduler did not say
    tool_parser: ToolCallParser | None = None  # how its tool calls are told from text (--tool-call-parser)
    eos_token_ids: tuple[int, ...] = ()
    adapters: dict[str, LoRAModule] = field(default_factory=dict)  # --lora-modules, by the name clients use
    trust_request_chat_template: bool = False  # a request may bring its own chat template
    pooler: PoolerConfig | None = None  # set: the engine runs a pooling model (embeddings, no generation)
    reasoning_parser: ReasoningParser | None = None  # how its reasoning is told from its answer (--reasoning-parser)
    aliases: tuple[str, ...] = ()  # other names it answers to (--served-model-name's after the first)
    path: str | None = None  # where the scheduler's model comes from (its card's root, as vLLM's)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" unless a request says
    max_loras: int = 0  # distinct LoRA adapters the engine runs in one step; 0: LoRA is not enabled
    priority_scheduling: bool = False  # the scheduler orders requests by their priority
    # the model's sampling defaults (--generation-config) for the fields a request leaves unset
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    image_prompts: ImagePrompts | None = None  # a vision-language model's processor; None: the model takes no images
    media: MediaOptions = field(default_factory=MediaOptions)  # how image URLs are read (media.py)
    _token_strings: dict[int, str] = field(default_factory=dict)

    @property
    def limits(self) -> RequestLimits:
        """What the engine allows a request, as the scheduler reported it: what validate checks here."""
        return RequestLimits(max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                             max_logprobs=self.max_logprobs, max_num_seqs=self.max_num_seqs,
                             eos_token_ids=self.eos_token_ids, max_loras=self.max_loras, pooler=self.pooler,
                             model_name=self.name, priority_scheduling=self.priority_scheduling,
                             image_token_id=self.image_prompts.image_token_id if self.image_prompts else None)

    @property
    def image_placeholder(self) -> str | None:
        """What marks an image's place in a prompt's text (LLaVA's <image>); None: the model takes no images."""
        return self.image_prompts.chat_placeholder if self.image_prompts is not None else None

    def resolve(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the model itself, also when it names none)."""
        if not requested or requested in self.names:
            return None
        module = self.adapters.get(requested)
        if module is None:
            served = ", ".join(f"`{name}`" for name in [*self.names, *self.adapters])
            raise NotFound(f"The model `{requested}` does not exist; this server serves {served}.")
        return module.lora

    @property
    def names(self) -> tuple[str, ...]:
        """The names it is served under: the first is the one answers carry."""
        return (self.name, *self.aliases)

    def check_name(self, requested: str | None) -> None:
        self.resolve(requested)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    **template_options) -> tuple[str, list[int]]:
        if chat_template is not None and not self.trust_request_chat_template:
            # As vLLM's: a template is code the gateway runs (sandboxed Jinja), so the operator opts in.
            raise InvalidParameter("a chat_template per request is refused unless the gateway runs with "
                                   "--trust-request-chat-template", "chat_template")
        # As the offline LLM.chat does: the template already holds any special tokens.
        text = render_chat(self.tokenizer, messages, chat_template=chat_template, **template_options)
        return text, self.encode(text, add_special_tokens=False)

    def encode_input(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """An embedding input's tokens: lowercased first where the pooling model says (do_lower_case)."""
        return self.encode(self.pooler.text(text) if self.pooler is not None else text, add_special_tokens)

    def encode_pair(self, text_1: str, text_2: str, limit: int | None = None) -> list[int]:
        """A cross-encoder's input: the two texts tokenized together, as the tokenizer joins a pair; at most
        ``limit`` tokens, the longer text trimmed to fit."""
        return list(self.tokenizer(self.pooler.text(text_1), self.pooler.text(text_2), truncation=limit is not None,
                                   max_length=limit).input_ids)

    def answer_name(self, lora: LoRARequest | None) -> str:
        """The model an answer names: the adapter's, when the request ran with one."""
        return lora.name if lora is not None else self.name

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def vocabulary_strings(self, token_ids: list[int]) -> list[str]:
        """The tokens as the vocabulary spells them ("Ġthe" for " the" in byte-level BPE), as vLLM's /tokenize."""
        return list(self.tokenizer.convert_ids_to_tokens(token_ids))

    def token_string(self, token_id: int) -> str:
        text = self._token_strings.get(token_id)
        if text is None:
            text = self._token_strings[token_id] = self.tokenizer.decode([token_id])
        return text

    def check_token_ids(self, token_ids: list[int]) -> None:
        """A prompt given as token ids must stay inside the vocabulary (before anything decodes it)."""
        check_token_ids(token_ids, self.vocab_size)

    def prepared(self, request: EngineRequest) -> EngineRequest:
        """The request as the engine takes it: its prompt truncated as it asks, its bad words as token ids."""
        if request.pooling is not None:
            return replace(request, prompt_token_ids=request.pooling.truncated(request.prompt_token_ids,
                                                                               self.max_model_len))
        params = request.params
        return replace(request, prompt_token_ids=params.truncated(request.prompt_token_ids, self.max_model_len),
                       params=params.with_bad_words_tokenized(lambda word: self.encode(word, add_special_tokens=False)))

    def checked(self, request: EngineRequest) -> EngineRequest:
        """The request prepared, if the engine would take it (what it would refuse is refused here, so a
        request of several prompts is all or nothing, before a run builds a detokenizer per sequence).
        Its errors name the fields as the APIs do (an embedding input is the prompt's ``input``)."""
        request = self.prepared(request)
        try:
            validate(request, self.limits)
        except ValueError as exc:
            error = InvalidParameter.from_params_error(exc)
            if request.pooling is not None and error.param == "prompt":
                error = error.renamed("input")
            raise error from None
        return request

    def logprob(self, position, text_offset: int = 0) -> TokenLogprob:
        top = [TopToken(t, self.token_string(t), _finite(lp))
               for t, lp in zip(position.top_token_ids, position.top_logprobs)]
        return TokenLogprob(position.token_id, self.token_string(position.token_id), _finite(position.logprob),
                            position.rank, top, text_offset)


def _finite(logprob: float) -> float:
    """As vLLM's: -inf (a token the model rules out) as -9999, which JSON can carry."""
    return max(logprob, -9999.0)
