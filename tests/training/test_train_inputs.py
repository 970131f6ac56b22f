"""train-draft's files, read and written: prompt files of every shape refused by file and line, a head published
whole or not at all, and cut-short files named instead of escaping as tracebacks."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from hyperdraft import LLM
from hyperdraft.cli import main as cli_main
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from hyperdraft.training import head_io
from hyperdraft.training.head_io import load_checkpoint, read_head, save_checkpoint, save_head
from hyperdraft.training.samples import load_prompts
from hyperdraft.models.config import load_model_config


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("inputs") / "target"), "llama", num_hidden_layers=4)


def _write(path, text: str | bytes) -> str:
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(path, mode) as f:
        f.write(text)
    return str(path)


def test_every_prompt_shape_is_read(tmp_path):
    rows = [{"prompt": "a"}, {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "b"}]},
            {"turns": ["c", "second turn"]}, {"text": "d"}]
    path = _write(tmp_path / "p.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_prompts(path) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("line, match", [
    ('"a bare string"', r":2: no prompt"),  # an AttributeError traceback
    ("7", r":2: no prompt"),
    ('{"conversations": "hi"}', r":2: no prompt"),  # a TypeError traceback
    ('{"turns": "hello world"}', r":2: no prompt"),  # trained on the prompt "h"
    ('{"prompt": ', r":2: not a JSON line"),
    ('{"other": "field"}', r":2: no prompt \(expected an object with a 'prompt'"),
])
def test_a_bad_prompt_row_is_named_by_file_and_line(tmp_path, line, match):
    path = _write(tmp_path / "p.jsonl", json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"p.jsonl{match}"):
        load_prompts(path)


def test_an_empty_or_binary_prompt_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"p.jsonl holds no prompts"):  # said "every prompt was too long"
        load_prompts(_write(tmp_path / "p.jsonl", "\n\n"))
    with pytest.raises(ValueError, match=r"b.jsonl is not UTF-8 text"):
        load_prompts(_write(tmp_path / "b.jsonl", b'{"prompt": "\xff\xfe"}\n'))


def _head(target: str, path) -> tuple[str, torch.nn.Module, dict]:
    from hyperdraft.models.eagle_loader import load_eagle_head
    from hyperdraft.models.loader import load_model

    head_dir = write_random_eagle_checkpoint(str(path), target, kind="eagle3")
    model = load_model(target, "float32", torch.device("cpu"))
    with open(os.path.join(head_dir, "config.json")) as f:
        return head_dir, load_eagle_head(head_dir, model), json.load(f)


def test_a_publish_cut_short_leaves_the_head_published_before(target, tmp_path, monkeypatch):
    """The weights were rewritten in place: a run killed while publishing epoch 2 left a truncated file where epoch
    1's usable head had been."""
    head_dir, head, config = _head(target, tmp_path / "head")
    before = open(os.path.join(head_dir, "model.safetensors"), "rb").read()

    def killed(tensors, path):
        _write(path, b"\x00" * 100)  # part of a file, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(head_io, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        save_head(head_dir, config, head, torch.float32)
    assert open(os.path.join(head_dir, "model.safetensors"), "rb").read() == before
    assert read_head(head_dir, load_model_config(target)).tensors.keys() == head.state_dict().keys()


def test_a_diverged_head_is_not_published(target, tmp_path):
    head_dir, head, config = _head(target, tmp_path / "head")
    before = open(os.path.join(head_dir, "model.safetensors"), "rb").read()
    with torch.no_grad():
        head.norm.weight[3] = float("nan")
    with pytest.raises(ValueError, match=r"training diverged: the head's \['norm.weight'\] hold NaN or inf"):
        save_head(head_dir, config, head, torch.float32)
    assert open(os.path.join(head_dir, "model.safetensors"), "rb").read() == before


def test_cut_short_files_are_named(target, tmp_path, capsys):
    """A truncated checkpoint said only '[Errno 22] Invalid argument'; a truncated head escaped train-draft's --init,
    the engine and the CLI as a SafetensorError traceback."""
    save_checkpoint(str(tmp_path), {"epoch": 0})
    path = tmp_path / "checkpoint.pt"
    _write(path, open(path, "rb").read()[:20])
    with pytest.raises(ValueError, match=r"--resume: .*checkpoint.pt cannot be read"):
        load_checkpoint(str(tmp_path))
    head_dir, _, _ = _head(target, tmp_path / "head")
    weights = os.path.join(head_dir, "model.safetensors")
    _write(weights, open(weights, "rb").read()[:200])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        read_head(head_dir, load_model_config(target))
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        LLM(target, device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir)
    assert cli_main(["generate", "--model", target, "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "2",
                     "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head_dir]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


def test_an_init_head_reading_layers_the_target_lacks_is_refused(target, tmp_path):
    """It failed at the first batch, after every prompt was answered, naming a shape."""
    deeper = make_tiny_model(str(tmp_path / "deeper"), "llama", num_hidden_layers=8)
    head_dir = write_random_eagle_checkpoint(str(tmp_path / "head"), deeper, kind="eagle3",
                                             eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})
    with pytest.raises(ValueError, match=r"init: .* reads target layers \[1, 3, 6\]; the target has num_layers=4"):
        read_head(head_dir, load_model_config(target))


def test_paths_are_named_by_option(target, tmp_path, capsys):
    """--out naming a file said only '[Errno 17] File exists', a missing --prompts '[Errno 2] No such file or
    directory', a missing --init 'draft model path ... has no config.json': none named the option."""
    a_file = _write(tmp_path / "a_file", "x")
    prompts = _write(tmp_path / "p.jsonl", json.dumps({"prompt": "hello"}) + "\n")
    base = ["train-draft", "--model", target, "--device", "cpu", "--epochs", "1"]
    cases = [(["--out", a_file, "--prompts", prompts], "out '.*a_file' is a file: give a directory"),
             (["--out", str(tmp_path / "o1"), "--prompts", str(tmp_path / "nope.jsonl")],
              "prompts '.*nope.jsonl' is not a file: give a JSONL file of prompts"),
             (["--out", str(tmp_path / "o2"), "--prompts", str(tmp_path)], "prompts '.*' is not a file"),
             (["--out", str(tmp_path / "o3"), "--prompts", prompts, "--init", str(tmp_path / "nohead")],
              "init '.*nohead' is not a directory: give a head directory")]
    for args, message in cases:
        assert cli_main(base + args) == 2
        assert re.search(f"^hyperdraft: error: {message}", capsys.readouterr().err), args
    assert sorted(os.listdir(tmp_path)) == ["a_file", "p.jsonl"]  # refused before anything was written
