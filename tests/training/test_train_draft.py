"""`hyperdraft train-draft` on a tiny model, on CPU: the loss falls, the written head loads through EAGLE3 and keeps
speculation lossless, it accepts more drafts than an untrained head, resuming reproduces an uninterrupted run, and
the training-time-test unroll computes exactly what sequential drafting at inference computes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from conftest import assert_engine_clean
from hyperdraft import LLM, SamplingParams
from hyperdraft.cli import main as cli_main
from hyperdraft.models.eagle import Eagle3Head, eagle_config_from_dict, target_capture_layers
from hyperdraft.models.loader import load_model
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import CORPUS, make_tiny_model
from hyperdraft.training.draft_vocab import frequent_tokens
from hyperdraft.training.samples import refuse_evaluation_prompts
from hyperdraft.training.trainer import TrainConfig, _batch_loss, _causal_within, train_draft
from hyperdraft.training.unroll_attention import UnrollAttention

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = CORPUS[:6]
EPOCHS = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = make_tiny_model(str(tmp_path_factory.mktemp("train") / "target"), "llama", num_hidden_layers=6)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)
    return path


def _config(target, out, prompts_file, **kw) -> TrainConfig:
    base = dict(num_samples=len(PROMPTS), max_len=96, epochs=3, lr=3e-3, draft_vocab_size=200, ttt_steps=3,
                progress=False, batch_size=2)
    return TrainConfig(target, str(out), prompts_file, **{**base, **kw})


@pytest.fixture(scope="module")
def trained(target, prompts_file, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("head")
    assert cli_main(["train-draft", "--model", target, "--out", str(out), "--prompts", prompts_file,
                     "--num-samples", str(len(PROMPTS)), "--max-len", "96", "--epochs", str(EPOCHS), "--lr", "5e-3",
                     "--draft-vocab-size", "200", "--ttt-steps", "3", "--batch-size", "2", "--device", "cpu"]) == 0
    return str(out)


def test_loss_falls_and_accuracy_rises(trained):
    with open(os.path.join(trained, "train_log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    log = [row for row in rows if row["kind"] == "epoch"]
    assert [row["epoch"] for row in log] == list(range(1, EPOCHS + 1))
    assert [row["step"] for row in rows if row["kind"] == "window"] == [len(PROMPTS) * e for e in range(1, EPOCHS + 1)]
    assert log[0]["loss"] > log[EPOCHS // 2]["loss"] > log[-1]["loss"], log
    assert log[-1]["accuracy_by_step"][0] > log[0]["accuracy_by_step"][0] + 0.2, log
    assert os.path.getsize(os.path.join(trained, "training.png")) > 1000  # the curves, drawn


def test_writes_the_published_eagle3_layout(trained, target):
    with open(os.path.join(trained, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 200
    assert len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
    names = set(load_file(os.path.join(trained, "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= names
    assert not any("embed" in n for n in names)  # the target's embedding is shared at load time


def test_trained_head_is_lossless_and_accepts_more_than_an_untrained_one(trained, target, tmp_path):
    llm_off = LLM(target, device="cpu", dtype="float32")
    prompts = [llm_off.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in llm_off.generate(input_ids=prompts, sampling_params=greedy, use_tqdm=False)]
    untrained = write_random_eagle_checkpoint(str(tmp_path / "random"), target, kind="eagle3", draft_vocab_size=200)
    rates = {}
    for name, head in (("trained", trained), ("untrained", untrained)):
        llm = LLM(target, device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
                  speculative_draft_model_path=head, speculative_num_steps=3)
        assert [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=greedy, use_tqdm=False)] == want
        state = llm.get_server_info()["internal_states"][0]
        rates[name] = state["spec_accepted_tokens"] / state["spec_draft_tokens"]
        assert_engine_clean(llm)
    assert rates["trained"] > rates["untrained"] + 0.05, rates


def test_resume_continues_exactly_where_it_stopped(target, prompts_file, tmp_path):
    straight = _config(target, tmp_path / "straight", prompts_file, epochs=2)
    train_draft(straight)
    first = _config(target, tmp_path / "resumed", prompts_file, epochs=1)
    train_draft(first)
    resumed = train_draft(_config(target, tmp_path / "resumed", prompts_file, epochs=2, resume=True))
    a, b = (load_file(os.path.join(str(tmp_path / d), "model.safetensors")) for d in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["epoch"] == 2
    with open(os.path.join(str(tmp_path / "resumed"), "train_log.jsonl")) as f:
        assert [row["epoch"] for row in map(json.loads, f) if row["kind"] == "epoch"] == [1, 2]


def _target_and_head(target: str, head_dir: str):
    """The target (fp32, CPU) and the head train-draft wrote, built as the trainer builds it."""
    model = load_model(target, "float32", torch.device("cpu"))
    with open(os.path.join(head_dir, "config.json")) as f:
        cfg = eagle_config_from_dict(json.load(f))
    head = Eagle3Head(cfg, model, own_embed=False, own_lm_head=True,
                      aux_layer_ids=tuple(cfg.eagle_aux_hidden_state_layer_ids))
    head.load_state_dict(load_file(os.path.join(head_dir, "model.safetensors")), strict=False)
    head.finish_loading()
    return model, head


def test_unroll_equals_sequential_drafting(trained, target):
    """Step s of the unroll at position i is the s-th draft of the chain anchored at n = i - s + 1, drafted as the
    engine does: an extend over positions 0 .. n-1 fed the target's states, then one position per step fed the
    previous output (ground-truth tokens in both)."""
    model, head = _target_and_head(target, trained)
    ids = torch.tensor([5, 17, 3, 99, 42, 8, 61, 23, 7, 30, 12, 4])
    t, steps = ids.numel(), 3
    with torch.no_grad():
        _, captured = model(ids, torch.arange(t), _causal_within(1), target_capture_layers(head))
        hidden0 = head.project_target_hidden(torch.cat(captured, -1)[: t - 2])
        tokens, n_pos = ids[1:t - 1], t - 2
        unroll, attention, hidden = [], UnrollAttention(), hidden0
        for _ in range(steps):
            out = head(tokens, torch.arange(n_pos), hidden, attention)
            unroll.append(out)
            hidden = torch.cat([out.new_zeros(1, out.shape[1]), out[:-1]])
        for anchor in range(1, n_pos - steps + 1):
            cache = _KVCache()
            g = head(tokens[:anchor], torch.arange(anchor), hidden0[:anchor], cache)[-1:]
            for s in range(1, steps):
                pos = anchor - 1 + s
                g = head(tokens[pos:pos + 1], torch.tensor([pos]), g, cache)
                torch.testing.assert_close(g[0], unroll[s][pos], rtol=1e-4, atol=1e-5)


class _KVCache:
    """Sequential attention as at inference: new queries see every cached key and the new ones causally."""

    def __init__(self):
        self.k = self.v = None

    def __call__(self, layer_id, q, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        past = self.k.shape[0] - q.shape[0]
        mask = torch.arange(self.k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + past
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), self.k.transpose(0, 1), self.v.transpose(0, 1), attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)


def test_draft_vocabulary_is_the_most_frequent_ids():
    vocab = frequent_tokens([[5, 5, 5, 2, 2, 9], [9, 9, 9, 9, 1]], vocab_size=12, size=3)
    assert vocab.target_ids.tolist() == [2, 5, 9]
    assert vocab.d2t.tolist() == [2, 4, 7]  # target id = draft id + d2t
    assert vocab.t2d(12).nonzero().flatten().tolist() == [2, 5, 9]
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 12\]"):
        frequent_tokens([[1]], vocab_size=12, size=13)


def test_mt_bench_prompts_are_refused(tmp_path):
    evaluation = tmp_path / "mt_bench_questions.jsonl"
    evaluation.write_text(json.dumps({"turns": ["What is the capital of France?", "And Spain?"]}) + "\n")
    refuse_evaluation_prompts(["Tell me a joke."], (str(evaluation),))
    with pytest.raises(ValueError, match="MT-bench questions"):
        refuse_evaluation_prompts(["Tell me a joke.", "What is the capital of France?"], (str(evaluation),))


def test_a_batch_trains_as_its_samples_one_by_one(trained, target):
    """Padding to one length and packing B sequences (the teacher's attention and the unroll's, each within its own
    sequence) change nothing: a batch's loss is the mean of its samples' losses alone, and its per-step counts their
    sums. Samples of different lengths, so padding and the answer mask both matter."""
    from hyperdraft.training.samples import Sample

    model, head = _target_and_head(target, trained)
    gen = torch.Generator().manual_seed(4)
    samples = [Sample(torch.randint(0, 384, (n,), generator=gen).tolist(), start)
               for n, start in ((23, 1), (40, 12), (31, 30))]
    draft_ids = head.draft_to_target
    with torch.no_grad():
        alone = [_batch_loss([s], model, head, draft_ids, 3) for s in samples]
        loss, correct, counted = _batch_loss(samples, model, head, draft_ids, 3)
    torch.testing.assert_close(loss, torch.stack([a[0] for a in alone]).mean(), rtol=1e-5, atol=1e-5)
    assert correct == [sum(a[1][s] for a in alone) for s in range(3)]
    assert counted == [sum(a[2][s] for a in alone) for s in range(3)] and counted[0] > counted[2] > 0


def test_answers_are_stored_and_a_stopped_run_answers_only_the_rest(target, tmp_path, monkeypatch):
    """The target's answers go to samples.jsonl chunk by chunk. A run stopped after some chunks (its time limit)
    resumes: prompts already answered are read back, only the rest reach the engine, and the samples equal an
    uninterrupted run's, in prompt order. A store made from other prompts is refused."""
    import hyperdraft.training.samples as samples_module
    from hyperdraft.training.samples import SampleStore, answer

    prompts = [p[:40] + f" #{i}" for i, p in enumerate(CORPUS * 2)][:10] + ["x " * 200]  # the last is too long
    llm = LLM(target, device="cpu", dtype="float32")
    seen: list[int] = []
    generate = llm.generate

    def counting_generate(*args, **kw):
        seen.append(len(kw["input_ids"]))
        return generate(*args, **kw)

    monkeypatch.setattr(llm, "generate", counting_generate)
    monkeypatch.setattr(samples_module, "ANSWER_CHUNK", 4)
    want = answer(llm, prompts, 96, 0.0, seed=0)  # in memory, uninterrupted
    path = str(tmp_path / "samples.jsonl")
    first = answer(llm, prompts[:5], 96, 0.0, seed=0, store=SampleStore(path))  # "stopped" after 5 prompts
    seen.clear()
    resumed = answer(llm, prompts, 96, 0.0, seed=0, store=SampleStore(path))
    assert resumed == want and first == want[:5]
    assert sum(seen) == 5, seen  # prompts 5..9 answered, the too-long one never sent
    assert len(open(path).read().splitlines()) == len(prompts)
    with pytest.raises(ValueError, match="holds answers to other prompts"):
        answer(llm, ["another"] + prompts[1:], 96, 0.0, seed=0, store=SampleStore(path))
    llm.shutdown()
