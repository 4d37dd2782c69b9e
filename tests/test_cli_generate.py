"""`flexengine generate`: runs on the embedded default model, streams, prints JSON, documents its flags."""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess

import pytest

from flexengine import LLM, SamplingParams
from flexengine import generate as generate_cmd
from flexengine.cli import main


def test_generate_streams_one_prompt(capsys):
    assert main(["generate", "hello", "--max-tokens", "5", "--temperature", "0", "--num-kv-blocks", "16"]) == 0
    printed = capsys.readouterr().out
    expected = LLM(num_kv_blocks=16).generate("hello", SamplingParams(temperature=0, max_tokens=5),
                                              use_tqdm=False)[0].outputs[0].text
    assert printed == expected + "\n" and len(expected) > 0


def test_generate_json_several_prompts(capsys):
    assert main(["generate", "one", "two words", "--max-tokens", "4", "--seed", "3", "--top-p", "0.9",
                 "--json", "--num-kv-blocks", "16"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in results] == ["one", "two words"]
    assert all(len(r["token_ids"]) == 4 and r["finish_reason"] == "length" and isinstance(r["text"], str)
               for r in results)


def test_generate_chat_uses_the_template_as_llm_chat_does(capsys, tmp_path):
    assert main(["generate", "Hi there", "--chat", "--max-tokens", "4", "--temperature", "0", "--json",
                 "--num-kv-blocks", "16"]) == 0
    [result] = json.loads(capsys.readouterr().out)
    [expected] = LLM(num_kv_blocks=16).chat([{"role": "user", "content": "Hi there"}],
                                            SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert result["prompt"] == expected.prompt != "Hi there" and "Hi there" in result["prompt"]
    assert result["token_ids"] == expected.outputs[0].token_ids
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert main(["generate", "yo", "--chat-template", str(template), "--max-tokens", "2", "--json",
                 "--num-kv-blocks", "16"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["prompt"] == "<user>yo"
    with pytest.raises(SystemExit, match="cannot read --chat-template"):
        main(["generate", "yo", "--chat-template", str(tmp_path / "missing.jinja"), "--num-kv-blocks", "16"])


def test_generate_several_prompts_prints_each(capsys):
    assert main(["generate", "a", "b", "--max-tokens", "2", "--temperature", "0", "--num-kv-blocks", "16"]) == 0
    out = capsys.readouterr().out
    assert "--- 'a'" in out and "--- 'b'" in out


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    parser = argparse.ArgumentParser()
    generate_cmd.add_arguments(parser)
    flags = [s for a in parser._actions if a.option_strings and a.dest != "help" for s in a.option_strings]
    for action in parser._actions:
        assert action.help, f"{action.dest} has no help text"
    for flag in ["--model", "--max-tokens", "--temperature", "--top-p", "--seed", "--json", "--dtype", "--device",
                 "--attention-backend", "--enforce-eager", "--ignore-eos"]:
        assert flag in flags
    for flag in flags:
        assert flag in text, f"{flag} missing from --help"


def test_bad_flag_value_is_an_error():
    with pytest.raises(ValueError, match="temperature"):
        main(["generate", "x", "--temperature", "-1", "--num-kv-blocks", "16"])


@pytest.mark.skipif(shutil.which("flexengine") is None, reason="console script not installed")
def test_console_script():
    """The documented command, as a user types it (default KV sizing, default sampling)."""
    proc = subprocess.run([shutil.which("flexengine"), "generate", "hello", "--max-tokens", "5"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and len(proc.stdout) > 1


def test_serve_without_its_extra_says_which_to_install(capsys):
    """`flexengine serve` where fastapi is missing: one line naming the extra, exit status 2."""
    import sys
    saved = {name: sys.modules.pop(name) for name in list(sys.modules)
             if name == "fastapi" or name.startswith("fastapi.") or name == "flexengine.server.api_server"}
    sys.modules["fastapi"] = None  # an import of it now raises ModuleNotFoundError
    try:
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--help"])
    finally:
        del sys.modules["fastapi"]
        sys.modules.update(saved)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'flexengine[serve]'" in err and "fastapi" in err
