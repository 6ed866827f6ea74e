"""Chat templates: a model directory's Jinja template rendered as transformers renders it.

    template = ChatTemplate.from_model_dir("/models/x")          # None when it has none
    text = template.render(messages, {"enable_thinking": False})  # add_generation_prompt=True

The template is found as transformers finds it: `chat_template.jinja` in the model
directory, else the `chat_template` field of `tokenizer_config.json` (a string, or
a list of named templates of which "default" is used); `--chat-template FILE`
overrides both. Rendering matches `PreTrainedTokenizer.apply_chat_template(messages,
add_generation_prompt=True, tokenize=False)` of transformers 5: an
`ImmutableSandboxedEnvironment` with trim_blocks and lstrip_blocks, the loop-control
extension, a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`
and a namespace that refuses underscore names; the template sees `messages`,
`add_generation_prompt`, `tools=None`, `documents=None`, the named special tokens of
tokenizer_config.json (bos_token, eos_token, ...) and the caller's kwargs, which
override them. The rendered text is then tokenized as it stands, with no BOS
added: the template writes its own. This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
NO_TEMPLATE = "this model has no chat template; use /v1/completions or --chat-template FILE"


class TemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML; chat templates want the plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without the type object itself (no attribute escapes)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed attributes (CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders
    its body unchanged; templates that mark assistant turns must still parse."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not parse: {err} (line {err.lineno})") from err
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None, template_file: str | Path | None = None
                       ) -> ChatTemplate | None:
        """The template of `model_dir` (or `template_file`, which wins); None when neither has one."""
        config: dict = {}
        path = Path(model_dir) if model_dir is not None else None
        if path is not None and (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        specials = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        if template_file is not None:
            file = Path(template_file)
            if not file.is_file():
                raise FileNotFoundError(f"--chat-template {file}: no such file")
            return cls(file.read_text(encoding="utf-8"), specials)
        if path is not None and (path / "chat_template.jinja").is_file():
            return cls((path / "chat_template.jinja").read_text(encoding="utf-8"), specials)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ValueError(f"{path}/tokenizer_config.json has chat templates {sorted(named)} but no "
                                 "'default'; pick one with --chat-template FILE")
            source = named["default"]
        return cls(source, specials) if isinstance(source, str) else None

    def render(self, messages: list[dict], kwargs: dict | None = None, *,
               add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending with the assistant's generation prompt
        (unless `add_generation_prompt` is False: /tokenize may ask so).

        `kwargs` (chat_template_kwargs) are visible to the template and override the
        special tokens; TemplateError when the template refuses the conversation.
        """
        # As transformers: message keys whose value is None are dropped.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        taken = sorted(set(kwargs or {}) & RESERVED)
        if taken:
            raise TemplateError(f"chat_template_kwargs: {taken} are set by the server")
        context = {**self.special_tokens, **(kwargs or {})}
        try:
            return self._template.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as err:  # raise_exception, sandbox refusals, bad syntax
            raise TemplateError(f"the chat template refused the conversation: {err}") from err
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError,
                OverflowError, RecursionError) as err:
            raise TemplateError(f"the chat template failed on this conversation: {type(err).__name__}: "
                                f"{err}") from err
