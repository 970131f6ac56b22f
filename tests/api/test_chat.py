"""LLM.chat, `hyperdraft generate --chat` and `hyperdraft demo` on a tiny model given a ChatML chat template."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hyperdraft import SamplingParams, demo
from hyperdraft.cli import main
from conftest import greedy

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world! How are you?"}]
TEMPLATED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello, world! How are you?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def chat_path(llama_path, tmp_path_factory) -> str:
    """The tiny llama with a ChatML chat template saved into its tokenizer files."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "llama-chat"
    shutil.copytree(llama_path, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    return str(path)


def test_chat_equals_generate_on_the_templated_prompt(make_llm, chat_path):
    llm = make_llm(chat_path)
    out = llm.chat(CONVERSATION, greedy(16))
    ref = llm.generate(TEMPLATED, greedy(16))
    assert out.token_ids == ref.token_ids and len(out.token_ids) == 16
    assert out.text == ref.text
    assert out.meta_info["prompt_tokens"] == ref.meta_info["prompt_tokens"] == len(llm.tokenizer.encode(TEMPLATED))


def test_chat_batch(make_llm, chat_path):
    llm = make_llm(chat_path)
    other = [{"role": "user", "content": "1 2 3 4 5"}]
    outs = llm.chat([CONVERSATION, other], greedy(12), use_tqdm=False)
    assert isinstance(outs, list) and len(outs) == 2
    assert [o.token_ids for o in outs] == [llm.chat(CONVERSATION, greedy(12)).token_ids, llm.chat(other, greedy(12)).token_ids]


def test_chat_without_template(make_llm, llama_path):
    llm = make_llm(llama_path)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CONVERSATION, greedy(4))


def test_chat_bad_messages(make_llm, chat_path):
    llm = make_llm(chat_path)
    for bad in ([], [{"role": "user"}], ["hello"]):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad, greedy(4))


def test_cli_generate_chat(make_llm, chat_path, capsys):
    argv = ["generate", "--model", chat_path, "--device", "cpu", "--dtype", "float32", "--chat",
            "--prompt", "Hello, world! How are you?", "--prompt", "1 2 3 4 5", "--max-new-tokens", "8", "--temperature", "0"]
    assert main(argv + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llm = make_llm(chat_path)
    expected = llm.chat([[{"role": "user", "content": "Hello, world! How are you?"}], [{"role": "user", "content": "1 2 3 4 5"}]],
                        SamplingParams(temperature=0.0, max_new_tokens=8), use_tqdm=False)
    assert [r["token_ids"] for r in rows] == [e.token_ids for e in expected]
    assert main(argv + ["--stream"]) == 0
    assert capsys.readouterr().out == "".join(e.text + "\n" for e in expected)


def test_cli_generate_chat_errors(llama_path, capsys):
    assert main(["generate", "--model", llama_path, "--device", "cpu", "--chat", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert "no chat template" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", llama_path, "--chat", "--input-ids", "1,2"])
    assert exit_.value.code == 2 and "--chat needs --prompt" in capsys.readouterr().err


def test_demo_on_tiny_model(chat_path, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(demo, "MT_BENCH", tmp_path / "missing.jsonl")  # the built-in prompts
    threads = torch.get_num_threads()
    try:
        assert main(["demo", "--model", chat_path, "--device", "cpu", "--max-new-tokens", "12", "--num-prompts", "2"]) == 0
    finally:
        torch.set_num_threads(threads)  # the demo uses every core; the rest of the suite runs on one thread
    out = capsys.readouterr().out
    assert out.count("### Answer") == 2 and demo.BUILTIN_PROMPTS[0] in out
    assert "NGRAM speculation (3 draft tokens)" in out and "no speculation" in out and "speed-up:" in out
    assert "lossless: identical token ids with and without speculation (2/2 prompts)" in out


def test_demo_with_a_trained_draft_head(monkeypatch, tmp_path, capsys):
    """`--draft-head`: the speculative run drafts with an EAGLE-3 head (a random one here) instead of NGRAM."""
    from transformers import AutoTokenizer

    from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
    from hyperdraft.testing.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "llama4"), "llama", seed=5, num_hidden_layers=4)  # EAGLE-3 reads 3 layers
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(model)
    head = write_random_eagle_checkpoint(str(tmp_path / "head"), model, kind="eagle3", draft_vocab_size=200)
    monkeypatch.setattr(demo, "MT_BENCH", tmp_path / "missing.jsonl")
    threads = torch.get_num_threads()
    try:
        assert main(["demo", "--model", model, "--device", "cpu", "--max-new-tokens", "12", "--num-prompts", "1",
                     "--speculative-num-steps", "4", "--draft-head", head]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "EAGLE-3 head speculation (4 draft tokens)" in out and "NGRAM" not in out
    assert "speed-up:" in out and "(tokens/s, EAGLE-3 head vs no speculation)" in out
    assert "lossless: identical token ids with and without speculation (1/1 prompts)" in out


def test_every_sampling_field_is_a_generate_flag(llama_path):
    """README: every SamplingParams field is a flag (no_stop_trim was not), but max_tokens, the OpenAI alias of
    --max-new-tokens."""
    from dataclasses import fields

    from hyperdraft.cli import build_parser, sampling_params_from_namespace

    ns = build_parser().parse_args(["generate", "--model", llama_path, "--no-stop-trim", "--stop", "x"])
    assert sampling_params_from_namespace(ns).no_stop_trim
    help_text = build_parser().parse_args(["generate", "--model", llama_path])
    assert [f.name for f in fields(SamplingParams) if not hasattr(help_text, f.name)] == ["max_tokens"]
