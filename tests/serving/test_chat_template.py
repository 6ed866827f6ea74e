"""Chat templates are found and rendered as transformers finds and renders them.

Each case writes a model directory (the byte-level tokenizer of the native presets, a
tokenizer_config.json, sometimes a chat_template.jinja) and compares
`ChatTemplate.render` with transformers' `apply_chat_template(messages,
add_generation_prompt=True, tokenize=False)` on the same directory, for templates that
use what real ones use: special tokens, `tojson`, `namespace`, loop controls,
`raise_exception`, kwargs. No engine."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest

from serving.entrypoints.openai.chat_template import ChatTemplate, TemplateError

QWEN_LIKE = """{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}{%- endif -%}
{%- if loop.first and ns.system %}<|im_start|>system\n{{ ns.system }}<|im_end|>\n{% endif -%}
<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n
{%- if m.role == 'assistant' and m.content == 'stop' %}{% break %}{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant\n
{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif -%}
{%- endif -%}"""
STRICT = """{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}
{{ raise_exception('unknown role ' + m.role) }}{% endif %}{{ m | tojson }}{{ eos_token }}
{% endfor %}{% if add_generation_prompt %}[{{ meta | tojson }}]{% endif %}"""
MESSAGES = [{"role": "system", "content": "Be <brief> & kind."}, {"role": "user", "content": "Héllo \"you\""},
            {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "2 + 2?"}]


def _dir(tmp_path, config: dict, jinja: str | None = None):
    with resources.as_file(resources.files("configs") / "tokenizers" / "byte-level.json") as f:
        shutil.copy(f, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
         "eos_token": {"__type": "AddedToken", "content": "<eos>", "special": True}, **config}))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def _transformers(path, messages, **kwargs) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_qwen_like_template_renders_as_transformers(tmp_path, kwargs):
    d = _dir(tmp_path, {"chat_template": QWEN_LIKE})
    ours = ChatTemplate.from_model_dir(d).render(MESSAGES, kwargs)
    assert ours == _transformers(d, MESSAGES, **kwargs)
    assert ("<think>" in ours) == (kwargs.get("enable_thinking") is False)


def test_special_tokens_tojson_and_refusals(tmp_path):
    d = _dir(tmp_path, {"chat_template": STRICT})
    template = ChatTemplate.from_model_dir(d)
    meta = {"a": "<x> & 'y'", "n": [1, 2]}
    ours = template.render(MESSAGES, {"meta": meta})
    assert ours == _transformers(d, MESSAGES, meta=meta)
    assert ours.startswith("<bos>") and '"<x> & \'y\'"' in ours  # tojson does not escape HTML
    with pytest.raises(TemplateError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(TemplateError, match="chat_template_kwargs"):
        template.render(MESSAGES, {"messages": []})
    with pytest.raises(TemplateError, match="refused"):  # the sandbox refuses attribute escapes
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(MESSAGES)


def test_the_template_is_found_as_transformers_finds_it(tmp_path):
    (tmp_path / "a").mkdir()
    file_wins = _dir(tmp_path / "a", {"chat_template": "config"}, jinja="file{{ messages | length }}")
    assert ChatTemplate.from_model_dir(file_wins).render(MESSAGES) == "file4"
    assert _transformers(file_wins, MESSAGES) == "file4"
    (tmp_path / "b").mkdir()
    named = _dir(tmp_path / "b", {"chat_template": [{"name": "default", "template": "D"},
                                                    {"name": "tool_use", "template": "T"}]})
    assert ChatTemplate.from_model_dir(named).render(MESSAGES) == "D" == _transformers(named, MESSAGES)
    (tmp_path / "c").mkdir()
    none = _dir(tmp_path / "c", {})
    assert ChatTemplate.from_model_dir(none) is None and ChatTemplate.from_model_dir(None) is None
    override = tmp_path / "override.jinja"
    override.write_text("O")
    assert ChatTemplate.from_model_dir(file_wins, override).render(MESSAGES) == "O"
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}")
