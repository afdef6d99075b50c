"""Chat templates rendered with jinja2 the way transformers renders them.

The same sandboxed environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``), the same ``tojson`` (no HTML escaping, non-ASCII
kept), ``raise_exception``, ``strftime_now``, a ``{% generation %}`` block that renders its
body, and the same variables: ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``...).
Templates come from checkpoints and are untrusted code: the sandbox refuses attribute
access to Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-token masks in transformers):
    renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):  # type: ignore[no-untyped-def]
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body
                                      ).set_lineno(lineno)

    def _render(self, caller):  # type: ignore[no-untyped-def]
        return caller()


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], *,
                         tools: list[dict] | None = None, documents: list[dict] | None = None,
                         add_generation_prompt: bool = True, **kwargs: object) -> str:
    """Render ``messages`` (dicts with ``role`` and ``content``) with ``template``.

    Raises:
        ValueError: a message is not a dict, or the template failed (syntax error, or its
            own ``raise_exception``, e.g. roles out of order); the message says which.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content, got "
                             f"{type(m).__name__}")
    # transformers drops keys whose value is None (OpenAI clients send content=None).
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return _compile(template).render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt,
                                         **kwargs)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"chat template: {exc}") from None
