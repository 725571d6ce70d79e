"""The prefill's token is the answer's first token: the decode continues after it.

A prefill vLLM computes the whole prompt and samples one token, exactly what a
colocated vLLM's first step does. The front door hands that token to the client at once
and asks the decode for the rest with the token appended to the prompt (as token ids):
the decode loads the prompt's KV, computes the token's position (what a colocated
vLLM's second step computes, over the same KV) and samples from there. The client's
first token then costs no decode step, and the decode computes nothing twice.

Only requests whose answer this split cannot change take it (:func:`continuation`):
one completion of one prompt, no stop strings, logprobs, echo, seed, penalties that
count output tokens, or ``min_tokens``; at least two tokens asked for; and a first
token that is whole text (not part of a character split across tokens) and not the
end. Everything else goes to the decode with the original prompt, which recomputes the
prompt's last position itself.

The pieces here are pure: the decode's body, the client's first event, and the
decode's events and answer rewritten to read as one completion (the prefill's id, the
prompt without the appended token, usage counting that token as output).
"""

from __future__ import annotations

from typing import Any

__all__ = ["continuation", "first_event", "merge_answer", "rewrite_event"]

# Keys of a /v1/completions body that mean the same with the first token moved into
# the prompt; any other key sends the request the usual way.
SAFE_KEYS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stream", "stream_options",
    "ignore_eos", "return_token_ids", "user", "stop_token_ids", "repetition_penalty", "skip_special_tokens",
})


def _single_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def qualifies(body: dict[str, Any]) -> bool:
    """Whether ``body`` (a /v1/completions request) may take its first token from the
    prefill: see the module doc."""
    if not set(body) <= SAFE_KEYS or not _single_prompt(body.get("prompt")):
        return False
    max_tokens = body.get("max_tokens")
    return isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 2


def continuation(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any] | None:
    """The decode's body that continues after the prefill's token, or None when the
    request goes the usual way (``body`` does not qualify, or the prefill's token ended
    the answer or is not whole text). ``prefill_answer`` is the prefill's non-streamed
    answer to a request with ``return_token_ids``."""
    if not qualifies(body):
        return None
    choices = prefill_answer.get("choices") or []
    if len(choices) != 1:
        return None
    choice = choices[0]
    tokens, prompt_ids, text = choice.get("token_ids"), choice.get("prompt_token_ids"), choice.get("text")
    if choice.get("finish_reason") != "length" or not isinstance(tokens, list) or len(tokens) != 1:
        return None
    if not isinstance(prompt_ids, list) or not prompt_ids or not isinstance(text, str) or not text or "\ufffd" in text:
        return None
    out = dict(body, prompt=[*prompt_ids, tokens[0]], max_tokens=body["max_tokens"] - 1)
    out["return_token_ids"] = True  # the rewrite strips the appended token from prompt_token_ids
    return out


def _first(prefill_answer: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = prefill_answer["choices"][0]
    return choice


def first_event(prefill_answer: dict[str, Any], want_ids: bool) -> dict[str, Any]:
    """The client's first streamed event: the prefill's token."""
    first = _first(prefill_answer)
    choice: dict[str, Any] = {"index": 0, "text": first["text"], "logprobs": None, "finish_reason": None,
                              "stop_reason": None}
    if want_ids:
        choice["token_ids"] = list(first["token_ids"])
        choice["prompt_token_ids"] = list(first["prompt_token_ids"])
    return {"id": prefill_answer.get("id"), "object": "text_completion", "created": prefill_answer.get("created"),
            "model": prefill_answer.get("model"), "choices": [choice]}


def _usage(usage: Any) -> Any:
    if not isinstance(usage, dict):
        return usage
    out = dict(usage)
    if isinstance(out.get("prompt_tokens"), int):
        out["prompt_tokens"] -= 1
    if isinstance(out.get("completion_tokens"), int):
        out["completion_tokens"] += 1
    return out


def rewrite_event(event: dict[str, Any], prefill_answer: dict[str, Any], want_ids: bool) -> dict[str, Any]:
    """One of the decode's streamed events as part of the client's completion: the
    prefill's id, no prompt ids (the first event had them), usage with the first token
    counted as output."""
    if "choices" not in event:  # an error event
        return event
    out = dict(event, id=prefill_answer.get("id"))
    choices = []
    for choice in event.get("choices") or []:
        choice = dict(choice)
        choice.pop("prompt_token_ids", None)
        if not want_ids:
            choice.pop("token_ids", None)
        choices.append(choice)
    out["choices"] = choices
    if "usage" in out:
        out["usage"] = _usage(out["usage"])
    return out


def merge_answer(decode_answer: dict[str, Any], prefill_answer: dict[str, Any], want_ids: bool) -> dict[str, Any]:
    """The decode's non-streamed answer with the prefill's token in front: one
    completion, as a colocated vLLM answers it."""
    first = _first(prefill_answer)
    out = dict(decode_answer, id=prefill_answer.get("id"))
    choice = dict(decode_answer["choices"][0])
    choice["text"] = first["text"] + (choice.get("text") or "")
    if want_ids:
        choice["token_ids"] = [*first["token_ids"], *(choice.get("token_ids") or [])]
        choice["prompt_token_ids"] = list(first["prompt_token_ids"])
    else:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    out["choices"] = [choice]
    out["usage"] = _usage(decode_answer.get("usage"))
    return out
