"""Chat prompts: a checkpoint's chat template rendered with jinja2, as transformers' ``apply_chat_template`` does.

The template comes from ``chat_template.jinja`` in the model folder (how recent transformers saves it) or the
``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of {"name", "template"} entries: the one
named "default"). It is rendered in a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks`` (the
settings transformers uses), the variables ``messages``, ``add_generation_prompt``, ``bos_token`` / ``eos_token``
(from tokenizer_config.json, as strings or {"content": ...} entries) and the helpers templates call:
``raise_exception(message)`` and ``strftime_now(format)``. The rendered text already holds the special tokens the
template writes (e.g. ``<s>``), so it is encoded without adding any.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os

from ft_jax.config import check_regular_file, file_present, read_json_file


class ChatTemplateError(ValueError):
    """No chat template in the model folder, a template that does not parse, or one that raised while rendering."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special-token strings it may use.

    Attributes: source (the file it came from), template (jinja2 source), bos_token, eos_token (strings or None).
    """

    source: str
    template: str
    bos_token: str | None = None
    eos_token: str | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for messages [{"role": "user" | "assistant" | "system", "content": str}, ...].

        Raises:
            ChatTemplateError: the template does not parse or raised (e.g. roles that do not alternate); the message
                names the source file.
        """
        import jinja2  # on use: 14 ms of every launch otherwise (docs/DESIGN.md sec. 20.27)
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            return env.from_string(self.template).render(messages=messages,
                                                         add_generation_prompt=add_generation_prompt,
                                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: chat template: {e}") from None


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model_dir: str | os.PathLike) -> ChatTemplate:
    """The chat template of a model folder (module docstring for where it is looked for).

    Raises:
        ChatTemplateError: neither chat_template.jinja nor a chat_template in tokenizer_config.json, or a field of
            the wrong type; the message names the folder or file.
        ValueError (ConfigError): tokenizer_config.json unreadable or not valid JSON (named).
    """
    model_dir = os.fspath(model_dir)
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config = {}
    if file_present(config_path, "tokenizer_config.json"):
        config = read_json_file(config_path, "tokenizer_config.json")
        if not isinstance(config, dict):
            raise ChatTemplateError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if file_present(jinja_path, "chat_template.jinja"):
        check_regular_file(jinja_path, "chat_template.jinja")
        with open(jinja_path, encoding="utf-8") as f:
            return ChatTemplate(jinja_path, f.read(), bos, eos)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        raise ChatTemplateError(f"{model_dir}: no chat template (neither chat_template.jinja nor a 'chat_template' "
                                "in tokenizer_config.json): give the prompt as plain text instead of using chat")
    if not isinstance(template, str):
        raise ChatTemplateError(f"{config_path}: field 'chat_template' should be a string or a list of "
                                f"{{name, template}} entries, got {type(template).__name__}")
    return ChatTemplate(config_path, template, bos, eos)
