"""Chat templates: the real SmolLM2 template, the ChatML fallback, and the sandbox."""
from __future__ import annotations

import pytest

from edgellm.chat import CHATML_TEMPLATE, ChatTemplate, render_chat
from edgellm.errors import TemplateError
from edgellm.fetch import model_path
from edgellm.gguf_file import GGUFFile
from edgellm.tokenizer import Tokenizer

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def smollm2_metadata():
    return GGUFFile(model_path("smollm2-135m")).metadata


@pytest.mark.real
def test_smollm2_template_renders_chatml(smollm2_metadata):
    template = smollm2_metadata["tokenizer.chat_template"]
    text = render_chat(template, USER_HI, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert text == (f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
    text = render_chat(template, messages, bos_token="", eos_token="", add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n")


@pytest.mark.real
def test_rendered_chat_tokenizes_to_control_tokens(smollm2_metadata):
    tok = Tokenizer.from_metadata(smollm2_metadata)
    text = render_chat(smollm2_metadata["tokenizer.chat_template"], USER_HI, bos_token="", eos_token="")
    ids = tok.tokenize(text, add_special=True, parse_special=True)
    im_start, im_end = 1, 2                    # <|im_start|>, <|im_end|> in SmolLM2's vocabulary
    assert [i for i in ids if i in (im_start, im_end)] == [im_start, im_end, im_start, im_end, im_start]
    assert tok.detokenize(ids, special=True) == text


def test_missing_template_falls_back_to_chatml():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(None, messages, bos_token="<bos>", eos_token="<eos>") == expected
    assert render_chat("", messages, bos_token="<bos>", eos_token="<eos>") == expected
    assert ChatTemplate(None).is_fallback and ChatTemplate(None).source == CHATML_TEMPLATE
    assert render_chat(None, messages, bos_token="", eos_token="",
                       add_generation_prompt=False) == expected[: -len("<|im_start|>assistant\n")]


@pytest.mark.real
def test_gemma3_file_has_no_template_so_chatml_is_used():
    md = GGUFFile(model_path("gemma3-270m")).metadata
    assert md.get("tokenizer.chat_template") is None
    assert render_chat(md.get("tokenizer.chat_template"), USER_HI, bos_token="<bos>",
                       eos_token="<eos>") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
    "{{ messages[0].update(role='system') }}",
])
def test_sandbox_refuses_unsafe_templates(template):
    with pytest.raises(TemplateError, match="sandbox forbids"):
        render_chat(template, USER_HI, bos_token="", eos_token="")


def test_template_errors_become_template_error():
    with pytest.raises(TemplateError, match="undefined"):
        render_chat("{{ os.system('id') }}", USER_HI, bos_token="", eos_token="")
    with pytest.raises(TemplateError, match="does not parse"):
        render_chat("{% for m in messages %}", USER_HI, bos_token="", eos_token="")
    with pytest.raises(TemplateError, match="rejected the messages: roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", USER_HI, bos_token="", eos_token="")
    with pytest.raises(TemplateError, match="ZeroDivisionError"):
        render_chat("{{ 1 // 0 }}", USER_HI, bos_token="", eos_token="")
    with pytest.raises(TemplateError, match="message 0"):
        render_chat(None, [{"content": "no role"}], bos_token="", eos_token="")


def test_hugging_face_environment():
    # trim_blocks / lstrip_blocks: block tags leave no newline or indentation behind
    template = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}"
    assert render_chat(template, USER_HI * 2, bos_token="", eos_token="") == "[hi]\n[hi]\n"
    # loop controls, tojson keeping non-ASCII text, {% generation %}, bos/eos and extra variables
    template = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m | tojson }}{% endfor %}{% generation %}<{{ tools[0] }}>{% endgeneration %}"
                "{{ eos_token }}")
    text = render_chat(template, [{"role": "user", "content": "héllo"}] * 2, bos_token="<s>",
                       eos_token="</s>", tools=["calc"])
    assert text == '<s>{"role": "user", "content": "héllo"}<calc></s>'
    year = render_chat("{{ strftime_now('%Y') }}", USER_HI, bos_token="", eos_token="")
    assert year.isdigit() and int(year) >= 2024
