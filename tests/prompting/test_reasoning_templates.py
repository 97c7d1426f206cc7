"""A reasoning model's chat template, used token by token: each new turn is the
template's own tokens for it, every sampled reply stays as sampled, the thinking switch
reaches the generation prompt both ways, and what apply_chat_template would render
otherwise is said."""

from __future__ import annotations

import pytest
from chat_templates import QWEN3_LIKE

from prefixgym.prompting.chat_format import HFTemplateFormat
from prefixgym.prompting.conversation import Conversation, mismatch_lines
from prefixgym.prompting.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("thinking", [None, True, False])
def test_turns_are_the_templates_and_replies_stay_as_sampled(tok, thinking) -> None:
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    fmt = HFTemplateFormat(tok, QWEN3_LIKE, template_kwargs=kwargs)
    assert [f.rule for f in fmt.template_mismatch] == ["PG101"]
    assert "apply_chat_template" in mismatch_lines(fmt)[0]
    conv = Conversation(tok, system="Be brief.", chat_format=fmt)
    header = "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking is False else "")
    replies = ["<think>\nTwo and two.\n</think>\n\nFour.<|im_end|>",
               "<think>\nThree more.\n</think>\n\nSeven.<|im_end|>"]
    expected = encode(tok, "<|im_start|>system\nBe brief.<|im_end|>\n")
    for question, reply in zip(("2 + 2?", "Add 3."), replies):
        conv.add_user(question)
        expected += encode(tok, f"<|im_start|>user\n{question}<|im_end|>\n")
        prompt = conv.generation_prompt().tokens
        assert prompt == expected + encode(tok, header)  # the switch reaches the header
        conv.add_sampled(encode(tok, reply), stop_reason="stop")
        expected += encode(tok, header) + encode(tok, reply) + encode(tok, "\n")
    assert conv.tokens == expected and conv.extension_ok
    # apply_chat_template would have stripped the first reply's reasoning
    rendered = tok.apply_chat_template(conv.messages, chat_template=QWEN3_LIKE, tokenize=False,
                                       **kwargs)
    assert "Two and two" not in rendered and "Two and two" in tok.decode(conv.tokens)


def test_the_switch_is_probed_with_the_template() -> None:
    """The probes render with the switches: a template that breaks only when thinking is
    off is accepted with it on and reports the break with it off."""
    breaks_when_off = QWEN3_LIKE + (  # marks the end of a conversation, with thinking off
        "{%- if enable_thinking is defined and enable_thinking is false and "
        "not add_generation_prompt -%}{{- '<|endoftext|>' -}}{%- endif -%}")
    tok = load_tokenizer()
    HFTemplateFormat(tok, breaks_when_off, template_kwargs={"enable_thinking": True})
    with pytest.raises(ValueError, match="not append-only"):
        HFTemplateFormat(tok, breaks_when_off, template_kwargs={"enable_thinking": False})
