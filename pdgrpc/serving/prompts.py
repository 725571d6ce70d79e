"""A front door's prompt -> token ids: ``input_ids``, ``prompt`` text or chat ``messages``.

The router and the colocated server both call :func:`request_ids`. Text is tokenized with
the served tokenizer (the checkpoint's with ``--model``, else the byte tokenizer); chat
``messages`` are first rendered with the checkpoint's chat template
(``tokenizer_config.json``'s ``chat_template``, Jinja) in a sandboxed environment, the way
``transformers``' ``apply_chat_template(..., add_generation_prompt=True)`` renders it, and
the rendered text is tokenized without adding specials again (the template writes them).

Torch-free: the router imports it.
"""

from __future__ import annotations

from typing import Any, Sequence

from pdgrpc.engine.errors import InvalidRequest
from pdgrpc.errors import EngineError

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "render_chat", "request_ids"]

DEFAULT_MAX_NEW_TOKENS = 16  # generate.proto: max_new_tokens defaults to 16 when 0
MAX_MESSAGES = 1024  # messages per request; more is refused


def render_chat(template: str | None, messages: Sequence[Any], specials: dict[str, str | None]) -> str:
    """The conversation as prompt text (``messages``: objects with ``role``, ``content``)."""
    if not template:
        raise InvalidRequest("messages: the served model has no chat template (tokenizer_config.json chat_template); send prompt or input_ids")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"messages: {len(messages)} messages, over the limit of {MAX_MESSAGES}")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidRequest(f"messages: the chat template refused them: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
        text: str = compiled.render(
            messages=[{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True,
            **{k: v for k, v in specials.items() if v is not None},
        )
    except InvalidRequest:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"messages: the chat template failed: {exc}") from None
    return text


def request_ids(request: Any, tokenizer: Any) -> list[int]:
    """Token ids of a ``GenerateRequest``; raises :class:`InvalidRequest` naming the field."""
    if request.input_ids:
        ids = list(request.input_ids)
        tokenizer.check_ids(ids, "input_ids")
        return ids
    if len(request.messages):
        if request.prompt:
            raise InvalidRequest("prompt: set prompt or messages, not both")
        specials = {k: tokenizer.special_token(k) for k in ("bos_token", "eos_token")} if hasattr(tokenizer, "special_token") else {}
        text = render_chat(getattr(tokenizer, "chat_template", None), request.messages, specials)
        try:
            ids = tokenizer.encode(text, add_bos=False)
        except EngineError as exc:
            raise InvalidRequest(f"messages: {exc}") from None
    else:
        try:
            ids = tokenizer.encode(request.prompt)
        except EngineError as exc:
            raise InvalidRequest(f"prompt: {exc}") from None
    if not ids:
        raise InvalidRequest("prompt: it is empty and this tokenizer adds no BOS token; send some text")
    return list(ids)
