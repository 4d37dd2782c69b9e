"""LLM.chat (vLLM's offline chat): the checkpoint's template, one conversation or many, clear errors."""
from __future__ import annotations

import pytest

from flexengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, num_kv_blocks=64, block_size=16)


def test_chat_is_generate_on_the_templated_prompt(llm):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert text.count("<bos>") <= 1 and "Hi there" in text
    expected = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    [out] = llm.chat(CONV, GREEDY, use_tqdm=False)
    assert out.prompt == text and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids


def test_a_list_of_conversations_keeps_its_order_and_templates_apply(llm):
    other = [{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "more"}]}]
    outs = llm.chat([CONV, other], GREEDY, use_tqdm=False)
    assert [o.prompt.count("Hi there") for o in outs] == [1, 0] and "Tell me more" in outs[1].prompt
    custom = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    [out] = llm.chat(other, GREEDY, chat_template=custom, use_tqdm=False)
    assert out.prompt == "[user] Tell me more\n>"
    [out] = llm.chat(other, GREEDY, chat_template=custom, add_generation_prompt=False, use_tqdm=False)
    assert out.prompt == "[user] Tell me more\n"


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty"), ("hello", "conversation"), ([{"content": "no role"}], "string 'role'"),
    ([CONV, []], "conversation 1"), ([{"role": "user", "content": 3}], "'content' must be"),
])
def test_bad_messages_are_value_errors_and_the_engine_stays_usable(llm, messages, message):
    free = llm.llm_engine.num_free_blocks()
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert llm.llm_engine.num_free_blocks() == free and not llm.llm_engine.requests
    assert len(llm.chat(CONV, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_a_tokenizer_without_a_template_says_what_to_do(llm):
    tok = llm.get_tokenizer()
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(ValueError, match="no chat template: pass chat_template"):
            llm.chat(CONV, GREEDY, use_tqdm=False)
    finally:
        tok.chat_template = saved
