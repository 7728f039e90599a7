"""Token logprobs in OpenAI's shapes, as vLLM returns them.

The sampled token leads its position's top tokens when it is among them (vLLM's order; a
completion's top map always starts with it), and with vLLM's ``return_tokens_as_token_ids`` each
token is named "token_id:<id>", which any client can map back to the vocabulary, where a token's
text alone may be a fragment of a character or repeat another token's.
"""

from __future__ import annotations

from services.gateway.deltas import TokenLogprob, TopToken
from services.gateway.run import Run


def token_label(token_id: int, text: str, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text


def top_sampled_first(entry: TokenLogprob, k: int) -> list[TopToken]:
    """The k most likely tokens, the sampled one first when it is among them (the rest by rank)."""
    top = entry.top[:k]
    for i, candidate in enumerate(top):
        if candidate.token_id == entry.token_id:
            return [candidate, *top[:i], *top[i + 1:]]
    return top


def chat_logprobs(entries: list[TokenLogprob], k: int, as_ids: bool) -> dict:
    """A chat choice's logprobs: each token with its k top ones."""
    return {"content": [{**_chat_token(e.token_id, e.token, e.logprob, as_ids),
                         "top_logprobs": [_chat_token(t.token_id, t.token, t.logprob, as_ids)
                                          for t in top_sampled_first(e, k)]}
                        for e in entries]}


def _chat_token(token_id: int, text: str, logprob: float, as_ids: bool) -> dict:
    # bytes are the token's text as UTF-8 (what a client joins to rebuild the text), whatever it is named.
    return {"token": token_label(token_id, text, as_ids), "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def completion_logprobs(entries: list[TokenLogprob], base_offset: int, as_ids: bool) -> dict:
    """A completion's logprobs; each top map holds the sampled token first, then the top k (as vLLM's)."""
    return {"tokens": [token_label(e.token_id, e.token, as_ids) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else _top_map(e, as_ids) for e in entries],
            "text_offset": [base_offset + e.text_offset for e in entries]}


def _top_map(entry: TokenLogprob, as_ids: bool) -> dict[str, float]:
    top = {token_label(entry.token_id, entry.token, as_ids): entry.logprob}
    for candidate in entry.top:
        top.setdefault(token_label(candidate.token_id, candidate.token, as_ids), candidate.logprob)
    return top


def vllm_prompt_logprobs(run: Run, num_top: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (null for the first, which nothing comes before) a
    map from token id to {logprob, rank, decoded_token}, the prompt's own token first, then the top ones."""
    entries = run.prompt_logprobs or []
    out: list[dict | None] = []
    for i in range(len(run.prompt)):
        entry = entries[i] if i < len(entries) else None
        if entry is None:
            out.append(None)
            continue
        position = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token}}
        for rank, top in enumerate(entry.top[:num_top], 1):
            position.setdefault(str(top.token_id), {"logprob": top.logprob, "rank": rank, "decoded_token": top.token})
        out.append(position)
    return out
