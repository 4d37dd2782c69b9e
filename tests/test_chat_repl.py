"""`flexengine chat` driven in a pseudo-terminal: what the screen shows against LLM.chat's own replies."""
from __future__ import annotations

import sys

import pytest

from flexengine import LLM, SamplingParams

pexpect = pytest.importorskip("pexpect", reason="pexpect is in the dev extra")

GREEDY = ["--temperature", "0", "--max-tokens", "12"]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, num_kv_blocks=64, block_size=16)


def reply(llm, conversation) -> str:
    return llm.chat(conversation, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text


def spawn(*args):
    return pexpect.spawn(sys.executable, ["-m", "flexengine.cli", "chat", *args], encoding="utf-8", timeout=120,
                         dimensions=(40, 200))


def test_chat_in_a_terminal(llm):
    """A system message, two turns (the second sees the first through the template), the replies on
    screen as LLM.chat gives them, a blank line ignored, /clear starting over (the system message kept),
    Ctrl-D quitting with status 0."""
    system = {"role": "system", "content": "be brief"}
    first = [system, {"role": "user", "content": "hello there"}]
    second = first + [{"role": "assistant", "content": reply(llm, first)}, {"role": "user", "content": "and then?"}]
    fresh = [system, {"role": "user", "content": "and then?"}]
    assert reply(llm, second) != reply(llm, fresh)  # so the screen shows whether history was used
    child = spawn(*GREEDY, "--num-kv-blocks", "64", "--system", "be brief")
    child.expect_exact("Ctrl-D quits")
    child.expect_exact(">>> ")
    child.sendline("hello there")
    child.expect_exact(">>> ")
    assert child.before == "hello there\r\n" + reply(llm, first) + "\r\n"
    child.sendline("")
    child.expect_exact(">>> ")
    child.sendline("and then?")
    child.expect_exact(">>> ")
    assert child.before == "and then?\r\n" + reply(llm, second) + "\r\n"
    child.sendline("/clear")
    child.expect_exact("(new conversation)")
    child.expect_exact(">>> ")
    child.sendline("and then?")
    child.expect_exact(">>> ")
    assert child.before == "and then?\r\n" + reply(llm, fresh) + "\r\n"
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_help_explains(capsys):
    from flexengine.cli import main
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    text = capsys.readouterr().out
    for words in ("--model", "--system", "--chat-template", "--max-tokens", "Ctrl-D", "smollm2-135m-instruct"):
        assert words in text


def test_reply_streams_token_by_token(llm, monkeypatch):
    """stream_reply writes each step's new text as it comes: one write per generated token here (the
    byte tokenizer makes one character per token), then the newline."""
    from flexengine.chat_repl import stream_reply

    class Screen:
        def __init__(self):
            self.writes = []

        def write(self, s):
            self.writes.append(s)

        def flush(self):
            pass

    screen = Screen()
    monkeypatch.setattr(sys, "stdout", screen)
    conv = [{"role": "user", "content": "stream me"}]
    text = stream_reply(llm, conv, SamplingParams(temperature=0, max_tokens=12), None, "t")
    assert text == reply(llm, conv)
    assert screen.writes == list(text) + ["\n"]
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_conversation_too_long_is_an_error_not_an_exit(llm, monkeypatch):
    from flexengine.chat_repl import stream_reply
    long = [{"role": "user", "content": "x" * (llm.llm_engine.max_model_len + 10)}]
    with pytest.raises(ValueError, match="the conversation is .* tokens, the model's limit is"):
        stream_reply(llm, long, SamplingParams(temperature=0, max_tokens=4), None, "too-long")
    assert not llm.llm_engine.has_unfinished_requests()
    assert reply(llm, [{"role": "user", "content": "still works"}])


def test_sampling_flags_over_generation_config(tmp_path):
    """Flags given win; then the checkpoint's generation_config.json; then the chat's own defaults."""
    import argparse
    from transformers import GenerationConfig
    from flexengine.chat_repl import DEFAULT_TEMPERATURE, add_arguments, sampling_params
    from test_loader import save_llama

    save_llama(tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plain = LLM(str(tmp_path), num_kv_blocks=16, block_size=16)
    params = sampling_params(plain, parser.parse_args(["--max-tokens", "7"]))
    assert (params.temperature, params.top_p, params.max_tokens) == (DEFAULT_TEMPERATURE, 1.0, 7)
    GenerationConfig(do_sample=True, temperature=0.3, top_p=0.8).save_pretrained(str(tmp_path))
    configured = LLM(str(tmp_path), num_kv_blocks=16, block_size=16)
    params = sampling_params(configured, parser.parse_args([]))
    assert (params.temperature, params.top_p) == (0.3, 0.8)
    params = sampling_params(configured, parser.parse_args(["--temperature", "0", "--top-k", "5"]))
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.8, 5)


def test_ctrl_c_stops_a_reply_and_frees_its_pages(llm, monkeypatch):
    """Ctrl-C while a reply streams (here: raised from the third write) aborts the request: the reply so
    far is kept, the KV pages come back, and the next reply is as if nothing happened."""
    from flexengine.chat_repl import stream_reply

    class Screen:
        def __init__(self):
            self.writes = []

        def write(self, s):
            self.writes.append(s)
            if len(self.writes) == 3:
                raise KeyboardInterrupt

        def flush(self):
            pass

    engine = llm.llm_engine
    free = engine.num_free_blocks()
    monkeypatch.setattr(sys, "stdout", Screen())
    conv = [{"role": "user", "content": "go on"}]
    text = stream_reply(llm, conv, SamplingParams(temperature=0, max_tokens=40), None, "interrupted")
    assert sys.stdout.writes[-2:] == [" [stopped]", "\n"]
    assert text == reply(llm, conv)[:3]  # the three pieces the screen got
    assert not engine.has_unfinished_requests() and engine.num_free_blocks() == free
