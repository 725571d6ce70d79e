"""A served chat template, compiled once.

A template is Jinja, rendered in a sandbox the way ``transformers``'
``apply_chat_template`` renders it (``trim_blocks``, ``lstrip_blocks``, loop controls, and
``raise_exception`` for a template that refuses its messages). :func:`compiled` compiles
each template text once per process: compiling costs a chat request far more than
rendering. :func:`check` refuses, where a template is loaded, one that is not valid Jinja:
served, it would fail every chat request.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from pdgrpc.engine.errors import InvalidRequest
from pdgrpc.errors import ConfigError

if TYPE_CHECKING:
    import jinja2

__all__ = ["check", "compiled"]


def _raise_exception(message: str) -> None:
    raise InvalidRequest(f"messages: the chat template refused them: {message}")


@functools.lru_cache(maxsize=16)
def compiled(template: str) -> "jinja2.Template":
    """``template`` compiled (raises ``jinja2.TemplateSyntaxError``)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def check(template: str, source: object) -> str:
    """``template``, read from ``source``, once it compiles; else :class:`ConfigError`."""
    import jinja2

    try:
        compiled(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{source}: the chat template is not valid Jinja: {exc} (line {exc.lineno})") from None
    return template
