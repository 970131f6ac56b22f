"""`hyperdraft train-draft` on a tiny model, on CPU: the loss falls, the written head loads through EAGLE3 and keeps
speculation lossless, it accepts more drafts than an untrained head, resuming reproduces an uninterrupted run, and
the training-time-test unroll computes exactly what sequential drafting at inference computes. Held-out prompts are
never trained on and choose the published epoch; the lr warms up and decays; several temperatures answer each
prompt several times; a bf16 target trains the head under autocast."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from conftest import assert_engine_clean
from hyperdraft.training.unroll_rounds import compare_rounds, load_target_and_head
from hyperdraft import LLM, SamplingParams
from hyperdraft.cli import main as cli_main
from hyperdraft.models.decoder import rotated
from hyperdraft.models.eagle import target_capture_layers
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import CORPUS, make_tiny_model
import hyperdraft.training.trainer as trainer
from hyperdraft.training.draft_vocab import DraftVocab, frequent_tokens
from hyperdraft.training.plan import accept_length_estimate, lr_schedule, split_samples
from hyperdraft.training.plot import plot_log
from hyperdraft.training.samples import Sample, SampleStore, answer, refuse_evaluation_prompts
from hyperdraft.training.trainer import TrainConfig, _batch_loss, causal_within, train_draft
from hyperdraft.training.unroll_attention import UnrollAttention

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = CORPUS[:6]
EPOCHS = 8
HELD_OUT = 0.34  # int(6 * 0.34) = 2 of the 6 prompts


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
                progress=False, batch_size=2, validation_fraction=0.0)
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
    assert config["torch_dtype"] == "float32"  # what the weights are stored in (the target's dtype)
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


class _Stop(Exception):
    """A run's time limit, as train_draft sees it: the process ends right after some epoch's checkpoint."""


def _after_checkpoint(mp: pytest.MonkeyPatch, hook) -> None:
    """hook(out_dir, state) runs after each checkpoint train_draft writes."""
    real = trainer.save_checkpoint

    def save(out_dir, state):
        real(out_dir, state)
        hook(out_dir, state)

    mp.setattr(trainer, "save_checkpoint", save)


def _stop_after(epoch: int):
    def hook(out_dir, state):
        if state["epoch"] + 1 == epoch:
            raise _Stop

    return hook


def _rows(out_dir, kind: str) -> list[dict]:
    with open(os.path.join(str(out_dir), "train_log.jsonl")) as f:
        return [row for row in map(json.loads, f) if row["kind"] == kind]


@pytest.mark.parametrize("fraction", [0.0, HELD_OUT])
def test_resume_continues_exactly_where_it_stopped(target, prompts_file, tmp_path, monkeypatch, fraction):
    """A run stopped after its first epoch (a time limit) and resumed writes what an uninterrupted run writes: the
    head bit for bit (the lr schedule's place included) and, with prompts held out, the same scores and published
    flags (the best score so far included)."""
    straight = train_draft(_config(target, tmp_path / "straight", prompts_file, validation_fraction=fraction))
    cfg = _config(target, tmp_path / "resumed", prompts_file, validation_fraction=fraction)
    with monkeypatch.context() as mp:
        _after_checkpoint(mp, _stop_after(1))
        with pytest.raises(_Stop):
            train_draft(cfg)
    resumed = train_draft(dataclasses.replace(cfg, resume=True))
    a, b = (load_file(os.path.join(str(tmp_path / d), "model.safetensors")) for d in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed == straight and resumed["epoch"] == 3
    assert _rows(tmp_path / "resumed", "epoch") == _rows(tmp_path / "straight", "epoch")
    assert [row["epoch"] for row in _rows(tmp_path / "resumed", "epoch")] == [1, 2, 3]
    assert [row["lr"] for row in _rows(tmp_path / "resumed", "window")] == \
        [row["lr"] for row in _rows(tmp_path / "straight", "window")]
    if fraction:
        assert all(row["accept_length_estimate"] == accept_length_estimate(row["accuracy_by_step"])
                   for row in _rows(tmp_path / "resumed", "validation"))


def test_the_log_holds_one_run_and_a_resumed_run_logs_each_window_once(target, prompts_file, tmp_path, monkeypatch):
    """A run stopped in the middle of its second epoch (after some of its windows were logged) and resumed from the
    first epoch's checkpoint logs what an uninterrupted run logs, each window once; a new run (no --resume) into the
    same directory starts a new log, where it used to append to the old run's (the plot joined the two)."""
    straight = tmp_path / "straight"
    train_draft(_config(target, straight, prompts_file, validation_fraction=HELD_OUT))
    cfg = _config(target, tmp_path / "resumed", prompts_file, validation_fraction=HELD_OUT)
    real_log, per_epoch = trainer.append_log, []

    def stop_mid_epoch_two(out_dir, row):
        real_log(out_dir, row)
        if row["kind"] == "epoch":
            per_epoch.append(row["step"])
        elif row["kind"] == "window" and per_epoch and row["step"] > per_epoch[0]:
            raise _Stop

    with monkeypatch.context() as mp:
        mp.setattr(trainer, "append_log", stop_mid_epoch_two)
        with pytest.raises(_Stop):
            train_draft(cfg)
    train_draft(dataclasses.replace(cfg, resume=True))
    for kind in ("window", "validation", "epoch"):
        assert [r["step"] for r in _rows(tmp_path / "resumed", kind)] == [r["step"] for r in _rows(straight, kind)]
    train_draft(_config(target, straight, prompts_file, epochs=1))  # a new run into the same directory
    assert [r["epoch"] for r in _rows(straight, "epoch")] == [1]


def test_resume_takes_the_same_files_by_a_relative_path(target, prompts_file, tmp_path, monkeypatch):
    """The checkpoint records the model and prompts as absolute paths: a resume naming the same files relative to the
    working directory continues the run (it was refused as another prompts file)."""
    cfg = _config(target, tmp_path / "run", prompts_file, epochs=2)
    with monkeypatch.context() as mp:
        _after_checkpoint(mp, _stop_after(1))
        with pytest.raises(_Stop):
            train_draft(cfg)
    monkeypatch.chdir(os.path.dirname(prompts_file))
    relative = dataclasses.replace(cfg, prompts=os.path.basename(prompts_file), resume=True)
    assert train_draft(relative)["epoch"] == 2


def test_an_init_run_holds_out_its_heads_held_out_prompts(target, prompts_file, tmp_path, caplog):
    """A head records its held-out prompts; a run started from it (--init) holds out those, whatever its --seed, so
    no prompt the head trained on is scored as unseen (another seed held out 1-2 of them here, and the held-out score
    read high). A resumed run keeps its split. A head without the record is warned of."""
    first = tmp_path / "first"
    train_draft(_config(target, first, prompts_file, epochs=1, validation_fraction=HELD_OUT))
    held = json.load(open(first / "held_out_prompts.json"))
    assert len(held) == 2
    for seed in (0, 1, 2):
        out = tmp_path / f"init{seed}"
        train_draft(_config(target, out, prompts_file, epochs=1, init=str(first), seed=seed,
                            validation_fraction=HELD_OUT))
        assert json.load(open(out / "held_out_prompts.json")) == held, seed
    assert "records no held-out prompts" not in caplog.text
    cfg = _config(target, tmp_path / "again", prompts_file, epochs=2, init=str(first), seed=1,
                  validation_fraction=HELD_OUT)
    train_draft(dataclasses.replace(cfg, epochs=1))
    train_draft(dataclasses.replace(cfg, epochs=2, init=None, resume=True))  # resumes the init run's split
    assert json.load(open(tmp_path / "again" / "held_out_prompts.json")) == held
    os.remove(first / "held_out_prompts.json")
    train_draft(_config(target, tmp_path / "old", prompts_file, epochs=1, init=str(first), validation_fraction=HELD_OUT))
    assert "--init: the head records no held-out prompts" in caplog.text


def test_resume_refuses_another_split_or_an_older_checkpoint(target, prompts_file, tmp_path):
    train_draft(_config(target, tmp_path, prompts_file, epochs=1))
    with pytest.raises(ValueError, match="validation_fraction"):
        train_draft(_config(target, tmp_path, prompts_file, epochs=2, resume=True, validation_fraction=HELD_OUT))
    with pytest.raises(ValueError, match="seed"):
        train_draft(_config(target, tmp_path, prompts_file, epochs=2, resume=True, seed=1))
    # the checkpoint's samples, vocabulary and optimizer go on: other values were ignored without a word
    for field, value in (("lr", 0.5), ("draft_vocab_size", 50), ("max_len", 64), ("temperatures", (0.0, 0.7))):
        with pytest.raises(ValueError, match=rf"--resume: {field} .* differs from the checkpoint's"):
            train_draft(_config(target, tmp_path, prompts_file, epochs=2, resume=True, **{field: value}))
    path = str(tmp_path / "checkpoint.pt")
    state = torch.load(path, weights_only=False)
    torch.save({k: v for k, v in state.items() if k not in ("scheduler", "best", "validation_fraction")}, path)
    with pytest.raises(ValueError, match="predates the lr schedule"):
        train_draft(_config(target, tmp_path, prompts_file, epochs=2, resume=True))


SCORES = [2.0, 1.5, 1.8, 2.5, 2.5, 1.0]  # epoch 3 loses to epoch 1 (a resumed run that forgot it would publish it)


@pytest.fixture(scope="module")
def validated(target, prompts_file, tmp_path_factory):
    """A run holding out 2 prompts, stopped after epoch 2 and resumed, its heads scored by SCORES in turn. -> (out
    dir, per epoch (the checkpoint's head, the published model.safetensors), every batch _batch_loss saw as
    (grad enabled, its samples' tokens), the final checkpoint)."""
    out = tmp_path_factory.mktemp("validated")
    snapshots, batches, scores = [], [], iter(SCORES)
    real_loss = trainer._batch_loss

    def seen(batch, *args):
        batches.append((torch.is_grad_enabled(), [tuple(s.token_ids) for s in batch]))
        return real_loss(batch, *args)

    def snapshot(out_dir, state):
        snapshots.append(({k: v.clone() for k, v in state["head"].items()},
                          load_file(os.path.join(out_dir, "model.safetensors"))))
        _stop_after(2)(out_dir, state)

    cfg = _config(target, out, prompts_file, epochs=len(SCORES), validation_fraction=HELD_OUT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "_batch_loss", seen)
        mp.setattr(trainer, "accept_length_estimate", lambda accuracy: next(scores))
        _after_checkpoint(mp, snapshot)
        with pytest.raises(_Stop):
            train_draft(cfg)
        train_draft(dataclasses.replace(cfg, resume=True))
    return str(out), snapshots, batches, torch.load(os.path.join(str(out), "checkpoint.pt"), weights_only=False)


def test_the_published_head_is_the_best_epochs(validated):
    out, snapshots, _, state = validated
    validation, epochs = _rows(out, "validation"), _rows(out, "epoch")
    assert [row["epoch"] for row in validation] == [row["epoch"] for row in epochs] == list(range(1, len(SCORES) + 1))
    assert [row["accept_length_estimate"] for row in validation] == SCORES
    assert all(row["validation"] == {k: v for k, v in v_row.items() if k not in ("kind", "epoch", "step")}
               for row, v_row in zip(epochs, validation))
    assert [row["published"] for row in epochs] == [True, False, False, True, False, False]
    assert [row["published"] for row in epochs] == [s > max(SCORES[:e], default=-math.inf)
                                                    for e, s in enumerate(SCORES)]
    assert state["best"] == 2.5 and state["epoch"] == len(SCORES) - 1
    last_published = None
    for (head, published), row in zip(snapshots, epochs):
        last_published = head if row["published"] else last_published
        assert published.keys() <= head.keys()
        assert all(torch.equal(published[k], last_published[k]) for k in published)
        assert row["published"] or not all(torch.equal(published[k], head[k]) for k in published)


def test_held_out_prompts_are_never_trained_on(validated, target):
    """The split is whole prompts, made from the checkpoint's samples alone (so a resume makes it again); training
    batches never hold a held-out sample, every validation holds all of them, and the draft vocabulary counts only
    the training answers."""
    _, _, batches, state = validated
    samples = [Sample(*s) for s in state["samples"]]
    train, held = split_samples(samples, HELD_OUT, 0)
    assert len(samples) == len(PROMPTS) and len(held) == 2 and len(train) == 4
    tokens = lambda group: {tuple(s.token_ids) for s in group}  # noqa: E731
    trained = {t for grad, batch in batches if grad for t in batch}
    scored = [t for grad, batch in batches if not grad for t in batch]
    assert trained == tokens(train) and not trained & tokens(held)
    assert sorted(scored) == sorted(list(tokens(held)) * len(SCORES))
    prompts = lambda group: {tuple(s.token_ids[:s.answer_start]) for s in group}  # noqa: E731
    assert len(prompts(held)) == 2 and not prompts(held) & prompts(train)
    with open(os.path.join(target, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    vocab = lambda group: frequent_tokens([s.token_ids[s.answer_start:] for s in group], vocab_size, 200)  # noqa: E731
    assert torch.equal(state["vocab"], vocab(train).target_ids)
    assert not torch.equal(state["vocab"], vocab(samples).target_ids)  # so the check above can tell


def test_split_holds_out_whole_prompts():
    """Several answers of one prompt (several temperatures) go to the same side; one answer per prompt: a seeded
    shuffle of the samples."""
    samples = [Sample([p, 100 + p, 200 + c], 2) for c in range(3) for p in range(10)]
    train, held = split_samples(samples, 0.3, seed=5)
    assert len(held) == 9 and len(train) == 21
    assert not {s.token_ids[0] for s in held} & {s.token_ids[0] for s in train}
    assert split_samples(samples, 0.3, seed=5) == (train, held) and split_samples(samples, 0.3, seed=6) != (train, held)
    assert split_samples(samples, 0.0, seed=5) == (samples, [])
    single = samples[:10]
    assert len(split_samples(single, 0.25, seed=1)[1]) == 2


def test_accept_length_estimate():
    assert accept_length_estimate([0.5, 0.5, 0.0]) == 1 + 0.5 + 0.25
    assert accept_length_estimate([1.0, 1.0]) == 3.0 and accept_length_estimate([0.0, 1.0]) == 1.0


def test_lr_warms_up_then_decays_to_a_tenth(target, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "LOG_EVERY", 1)  # a window row per optimizer step
    train_draft(_config(target, tmp_path, prompts_file, epochs=4, lr=2e-3))
    lrs = [row["lr"] for row in _rows(tmp_path, "window")]
    assert len(lrs) == 4 * 3  # 6 samples, 2 per batch
    peak = lrs.index(max(lrs))
    assert lrs[0] < lrs[peak] == pytest.approx(2e-3) and peak == 1  # warmup: max(1, 12 // 50) step
    assert all(a > b for a, b in zip(lrs[peak:], lrs[peak + 1:]))
    assert lrs[-1] == pytest.approx(2e-4)


def test_lr_schedule_shape():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = lr_schedule(optimizer, 200)
    lrs = []
    for _ in range(200):
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # 200 // 50 = 4 warmup steps
    assert lrs[4 + 97] == pytest.approx(0.55, abs=0.01) and lrs[-1] == pytest.approx(0.1)


def test_two_temperatures_answer_each_prompt_twice(target, prompts_file, tmp_path):
    """Copy c is answered into its own store at seed + c * prompts: the greedy copy is samples.jsonl as before, the
    sampled one samples_1.jsonl, and the checkpoint holds both in copy order."""
    train_draft(_config(target, tmp_path, prompts_file, epochs=1, temperatures=(0.0, 1.0)))
    stores = [SampleStore(str(tmp_path / name)) for name in ("samples.jsonl", "samples_1.jsonl")]
    greedy, sampled = ([store.done[i][1] for i in range(len(PROMPTS))] for store in stores)
    state = torch.load(str(tmp_path / "checkpoint.pt"), weights_only=False)
    kept = [s for s in greedy + sampled if s is not None]
    assert [Sample(*s) for s in state["samples"]] == kept and len(kept) > len(PROMPTS)
    assert any(g != s for g, s in zip(greedy, sampled) if g is not None and s is not None)
    llm = LLM(target, device="cpu", dtype="float32")
    assert answer(llm, list(PROMPTS), 96, 1.0, seed=len(PROMPTS)) == [s for s in sampled if s is not None]
    assert answer(llm, list(PROMPTS), 96, 0.0, seed=0) == [s for s in greedy if s is not None]
    llm.shutdown()


def test_bf16_target_trains_the_head_under_autocast(target, prompts_file, tmp_path, monkeypatch):
    """On CPU too: the head's products run in bf16 (seen in the logits' dtype), its parameters stay fp32, and the
    loss falls."""
    dtypes = set()
    real = trainer.Eagle3Head.compute_draft_logits

    def logits(self, hidden):
        out = real(self, hidden)
        dtypes.add(out.dtype)
        return out

    monkeypatch.setattr(trainer.Eagle3Head, "compute_draft_logits", logits)
    train_draft(_config(target, tmp_path, prompts_file, epochs=5, dtype="bfloat16"))
    log = _rows(tmp_path, "epoch")
    assert log[-1]["loss"] < log[0]["loss"] and log[-1]["accuracy_by_step"][0] > log[0]["accuracy_by_step"][0], log
    assert dtypes == {torch.bfloat16}
    state = torch.load(str(tmp_path / "checkpoint.pt"), weights_only=False)
    assert all(t.dtype == torch.float32 for t in state["head"].values() if t.is_floating_point())
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "model.safetensors")).values()
               if t.is_floating_point())


def test_fp32_target_trains_without_autocast(trained, target):
    model, head = load_target_and_head(target, trained)
    seen = []
    real = head.compute_draft_logits
    head.compute_draft_logits = lambda hidden: seen.append(real(hidden).dtype) or real(hidden)
    with torch.no_grad():
        _batch_loss([Sample(list(range(5, 30)), 10)], model, head, head.draft_to_target, 2, 0.0)
    assert seen == [torch.float32] * 2


@pytest.mark.parametrize("field, value, match", [("validation_fraction", 0.7, "validation_fraction"),
                                                 ("validation_fraction", -0.1, "validation_fraction"),
                                                 ("temperatures", (0.0, -1.0), "temperature"),
                                                 ("temperatures", (), "temperature"),
                                                 # inf and 2**63 were refused only when the first answer was asked for
                                                 ("temperatures", (0.0, float("inf")),
                                                  "temperature must be a finite number >= 0, got inf"),
                                                 ("seed", 2**63, r"seed must be an integer in \[-2\*\*63, 2\*\*62\)"),
                                                 ("seed", -2**63 - 1, r"seed must be an integer in"),
                                                 ("head_intermediate_size", 0, "head_intermediate_size"),
                                                 ("aux_layer_ids", (0, 0, 1), r"aux_layer_ids \[0, 0, 1\]"),
                                                 ("aux_layer_ids", (0, 1, 5), r"in \[0, 4\]"),
                                                 ("aux_layer_ids", (0, 1), "give 3 distinct"),
                                                 ("hard_label_weight", 1.5, r"hard_label_weight must be in \[0, 1\]"),
                                                 ("hard_label_weight", -0.1, "hard_label_weight"),
                                                 # inf trained and published a head of NaNs
                                                 ("lr", float("inf"), "lr must be a finite number > 0"),
                                                 # 0 meant the whole vocabulary; 10**6 failed after every answer
                                                 ("draft_vocab_size", 0, "draft_vocab_size must be >= 2"),
                                                 # 1: a one-token distribution, loss 0, an untrained head published
                                                 ("draft_vocab_size", 1, "draft_vocab_size must be >= 2"),
                                                 ("draft_vocab_size", 10**6,
                                                  r"draft_vocab_size must be at most the target's vocab_size=")])
def test_bad_values_are_refused(target, prompts_file, tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        train_draft(_config(target, tmp_path, prompts_file, **{field: value}))
    assert not os.listdir(tmp_path)  # refused before anything was answered or written
    eagle1 = write_random_eagle_checkpoint(str(tmp_path.parent / "eagle1"), target, kind="eagle")
    with pytest.raises(ValueError, match="is a LlamaForCausalLMEagle head; train-draft trains EAGLE-3 heads"):
        train_draft(_config(target, tmp_path, prompts_file, epochs=1, init=eagle1))


def test_a_wider_head_is_written_and_drafts_losslessly(target, prompts_file, tmp_path):
    """--head-intermediate-size widens the head's MLP: the config says so, the weights have that shape, and the head
    loads through EAGLE3 and keeps speculation lossless."""
    assert cli_main(["train-draft", "--model", target, "--out", str(tmp_path), "--prompts", prompts_file,
                     "--num-samples", "2", "--max-len", "64", "--epochs", "1", "--draft-vocab-size", "200",
                     "--ttt-steps", "2", "--head-intermediate-size", "256", "--validation-fraction", "0",
                     "--device", "cpu"]) == 0
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["intermediate_size"] == 256
    weights = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert weights["midlayer.mlp.down_proj.weight"].shape[1] == 256
    plain = LLM(target, device="cpu", dtype="float32")
    prompt = plain.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    want = plain.generate(input_ids=[prompt], sampling_params=greedy, use_tqdm=False)[0].token_ids
    llm = LLM(target, device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
              speculative_draft_model_path=str(tmp_path), speculative_num_steps=3)
    assert llm.generate(input_ids=[prompt], sampling_params=greedy, use_tqdm=False)[0].token_ids == want
    assert_engine_clean(llm)


def test_chosen_aux_layers_are_written_and_read_by_the_engine(target, prompts_file, tmp_path):
    """--aux-layers picks the target layers the head reads (here 0, 1 and 3, not the default 1, 2, 4): the config names
    them, and the engine feeds the head those layers: its chain rounds are the ones the unroll (which reads
    them from the config) predicts, and speculation stays lossless."""
    assert cli_main(["train-draft", "--model", target, "--out", str(tmp_path), "--prompts", prompts_file,
                     "--num-samples", "4", "--max-len", "96", "--epochs", "4", "--lr", "5e-3", "--draft-vocab-size",
                     "200", "--ttt-steps", "3", "--batch-size", "2", "--aux-layers", "3", "0", "1",
                     "--validation-fraction", "0", "--device", "cpu"]) == 0
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    plain = LLM(target, device="cpu", dtype="float32")
    llm = LLM(target, device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
              speculative_draft_model_path=str(tmp_path), speculative_num_steps=3, speculative_eagle_topk=1,
              speculative_num_draft_tokens=4)
    prompts = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    rows = compare_rounds(plain, llm, *load_target_and_head(target, str(tmp_path)), prompts, 3, new_tokens=24)
    assert all(row.output_equal and row.engine == row.unroll for row in rows), rows
    # the check can tell: an unroll fed the default layers (1, 2, 4) predicts other rounds than the engine runs
    other = compare_rounds(plain, llm, *load_target_and_head(target, str(tmp_path), aux_layer_ids=(1, 2, 4)), prompts,
                           3, new_tokens=24)
    assert any(row.engine != row.unroll for row in other), other
    assert_engine_clean(llm)


def test_resume_refuses_other_aux_layers(target, prompts_file, tmp_path):
    train_draft(_config(target, tmp_path, prompts_file, epochs=1, num_samples=2, aux_layer_ids=(0, 2, 4)))
    with pytest.raises(ValueError, match=r"aux_layer_ids \[1, 2, 4\] differ from the checkpoint's \[0, 2, 4\]"):
        train_draft(_config(target, tmp_path, prompts_file, epochs=2, num_samples=2, resume=True))


def test_resume_refuses_another_head_width(target, prompts_file, tmp_path):
    train_draft(_config(target, tmp_path, prompts_file, epochs=1, num_samples=2))
    with pytest.raises(ValueError, match="head_intermediate_size 256 differs from the checkpoint's 128"):
        train_draft(_config(target, tmp_path, prompts_file, epochs=2, num_samples=2, resume=True,
                            head_intermediate_size=256))


def test_cli_passes_temperatures_and_validation_fraction(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(trainer, "train_draft", lambda cfg: seen.append(cfg) or {})
    assert cli_main(["train-draft", "--model", "m", "--out", str(tmp_path), "--temperature", "0", "0.7",
                     "--validation-fraction", "0.1"]) == 0
    assert cli_main(["train-draft", "--model", "m", "--out", str(tmp_path)]) == 0
    assert cli_main(["train-draft", "--model", "m", "--out", str(tmp_path), "--prompts", "p.jsonl",
                     "--self-prompts", "5"]) == 0
    assert [(c.temperatures, c.validation_fraction, c.self_prompts) for c in seen] == [
        ((0.0, 0.7), 0.1, 0), ((0.0,), 0.02, 0), ((0.0,), 0.02, 5)]


def test_unroll_equals_sequential_drafting(trained, target):
    """Step s of the unroll at position i is the s-th draft of the chain anchored at n = i - s + 1, drafted as the
    engine does: an extend over positions 0 .. n-1 fed the target's states, then one position per step fed the
    previous output (ground-truth tokens in both)."""
    model, head = load_target_and_head(target, trained)
    ids = torch.tensor([5, 17, 3, 99, 42, 8, 61, 23, 7, 30, 12, 4])
    t, steps = ids.numel(), 3
    with torch.no_grad():
        _, captured = model(ids, torch.arange(t), causal_within(1), target_capture_layers(head))
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

    def __call__(self, layer_id, q, k, v, rope=None):
        q, k = rotated(q, k, rope)
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        past = self.k.shape[0] - q.shape[0]
        mask = torch.arange(self.k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + past
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), self.k.transpose(0, 1), self.v.transpose(0, 1), attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)


def test_plot_of_a_log_without_windows_is_a_named_error(tmp_path):
    (tmp_path / "train_log.jsonl").write_text("")
    assert cli_main(["train-draft", "--plot", str(tmp_path)]) == 2  # "holds no training windows", not a traceback
    with pytest.raises(ValueError, match="holds no training windows to draw"):
        plot_log(str(tmp_path))


def test_draft_vocabulary_is_the_most_frequent_ids():
    vocab = frequent_tokens([[5, 5, 5, 2, 2, 9], [9, 9, 9, 9, 1]], vocab_size=12, size=3)
    assert vocab.target_ids.tolist() == [2, 5, 9]
    assert vocab.d2t.tolist() == [2, 4, 7]  # target id = draft id + d2t
    assert vocab.t2d(12).nonzero().flatten().tolist() == [2, 5, 9]
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 12\]"):
        frequent_tokens([[1]], vocab_size=12, size=13)
    assert vocab.coverage([[5, 5, 1], [9, 11, 2, 0]]) == pytest.approx(4 / 7)  # 1, 11 and 0 are not in it
    assert vocab.coverage([[2, 9], [5]]) == 1.0


def test_validation_reports_the_draft_vocabulary_coverage(validated):
    """Each validation row says what share of the held-out answers' tokens the draft vocabulary holds."""
    out, _, _, state = validated
    _, held = split_samples([Sample(*s) for s in state["samples"]], HELD_OUT, 0)
    expected = DraftVocab(state["vocab"]).coverage([s.token_ids[s.answer_start:] for s in held])
    assert 0 < expected < 1  # 200 of the tiny model's ids: some held-out answer tokens fall outside
    assert [row["vocab_coverage"] for row in _rows(out, "validation")] == [pytest.approx(expected)] * len(SCORES)


def test_mt_bench_prompts_are_refused(tmp_path):
    """With the questions file: a prompt that is a question (any turn) or contains one. Without it (a run started
    outside the checkout, or an installed copy), the packaged hashes still refuse a question however spaced,
    capitalised or punctuated, and a prompt holding most of one's runs of words: text around it, its final period
    dropped, a curly apostrophe, a zero-width space (the exact fingerprints let those through)."""
    from hyperdraft.training.evaluation_set import EvaluationSet, mt_bench

    question = "Explain the difference between a llama's diet and an alpaca's diet in two short paragraphs."
    evaluation = tmp_path / "mt_bench_questions.jsonl"
    evaluation.write_text(json.dumps({"turns": [question, "And Spain?"]}) + "\n")
    refuse_evaluation_prompts(["Tell me a joke."], (str(evaluation),))
    for leak in (question, "and  SPAIN?", f"Please answer: {question} Now."):
        with pytest.raises(ValueError, match="MT-bench questions"):
            refuse_evaluation_prompts(["Tell me a joke.", leak], (str(evaluation),))
    packaged = EvaluationSet.of([question, "And Spain?"])
    near = ["Explain the difference between a llama\u2019s diet and an alpaca\u2019s diet in two short paragraphs",
            f"Please help: {question} Thanks!", question.replace("short ", "short\u200b "),
            "  explain the DIFFERENCE between a llama's diet\nand an alpaca's diet in two short paragraphs.",
            "Explain the difference between a llama's diet and an alpaca's diet.", "AND spain"]
    for leak in near:
        with pytest.raises(ValueError, match="MT-bench questions"):
            refuse_evaluation_prompts(["Tell me a joke.", leak], (), packaged)
    for fine in ("Tell me a joke.", "What does a llama eat?", "And Spain? And Portugal, and Italy too?",
                 "Explain the difference between a horse's diet and a cow's diet in detail."):
        refuse_evaluation_prompts([fine], (), packaged)
    mt = mt_bench()
    assert len(mt.fingerprints) == 160 and 150 < len(mt.questions) <= 160  # both turns of 80 questions; the few
    assert all(mt.questions)  # shorter than a run are matched by their fingerprints alone


def test_a_batch_trains_as_its_samples_one_by_one(trained, target):
    """Padding to one length and packing B sequences (the teacher's attention and the unroll's, each within its own
    sequence) change nothing: a batch's loss is the mean of its samples' losses alone, and its per-step counts their
    sums. Samples of different lengths, so padding and the answer mask both matter."""
    from hyperdraft.training.samples import Sample

    model, head = load_target_and_head(target, trained)
    gen = torch.Generator().manual_seed(4)
    samples = [Sample(torch.randint(0, 384, (n,), generator=gen).tolist(), start)
               for n, start in ((23, 1), (40, 12), (31, 30))]
    draft_ids = head.draft_to_target
    with torch.no_grad():
        alone = [_batch_loss([s], model, head, draft_ids, 3, 0.0) for s in samples]
        loss, correct, counted = _batch_loss(samples, model, head, draft_ids, 3, 0.0)
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
    assert len(open(path).read().splitlines()) == 1 + len(prompts)  # what made them, then one line a prompt
    with pytest.raises(ValueError, match="holds answers to other prompts"):
        answer(llm, ["another"] + prompts[1:], 96, 0.0, seed=0, store=SampleStore(path))
    seen.clear()  # fewer prompts than the store answered (a smaller --num-samples): its first answers, none asked
    assert answer(llm, prompts[:5], 96, 0.0, seed=0, store=SampleStore(path)) == want[:5] and not seen
    whole = open(path).read()
    with open(path, "w") as f:  # a run killed while appending its last line
        f.write(whole[:-25])
    assert answer(llm, prompts, 96, 0.0, seed=0, store=SampleStore(path)) == want
    assert open(path).read() == whole  # the cut line replaced by the prompt's answer again
    lines = whole.splitlines(keepends=True)
    with open(path, "w") as f:  # a bad line inside the file is named, not guessed at
        f.writelines(lines[:3] + ["{not json\n"] + lines[3:])
    with pytest.raises(ValueError, match=r"samples.jsonl:4: not a JSON line"):
        SampleStore(path)
    llm.shutdown()


def test_answers_made_with_other_settings_are_refused(target, prompts_file, tmp_path, caplog):
    """A second run into the same --out trained on the first run's answers whatever made them: another target, another
    temperature or max_len. The store records what made it; a store from before the record is used with a warning."""
    train_draft(_config(target, tmp_path, prompts_file, epochs=1))
    os.remove(tmp_path / "checkpoint.pt")  # new runs over the same --out, not resumes
    other = make_tiny_model(str(tmp_path.parent / "other_target"), "llama", num_hidden_layers=6, seed=3)
    for change, named in ((dict(max_len=64), "max_len 96, this run 64"), (dict(temperatures=(0.7,)), "temperature"),
                          (dict(seed=5), "seed 0, this run 5")):
        with pytest.raises(ValueError, match=rf"samples.jsonl holds answers made with other settings \(.*{named}"):
            train_draft(_config(target, tmp_path, prompts_file, epochs=1, **change))
    with pytest.raises(ValueError, match=r"holds answers made with other settings \(model "):
        train_draft(_config(other, tmp_path, prompts_file, epochs=1))
    path = str(tmp_path / "samples.jsonl")
    lines = open(path).read().splitlines()
    with open(path, "w") as f:  # as stores were written before the record
        f.write("\n".join(lines[1:]) + "\n")
    with caplog.at_level("WARNING"):
        assert len(SampleStore(path).done) == len(PROMPTS)
    assert "does not record the model" in caplog.text


def test_written_prompts_are_added_after_the_file_and_reused(target, prompts_file, tmp_path):
    """self_prompts=N with a prompts file: the target writes N requests of each kind in turn (self_prompts.jsonl),
    answered after the file's prompts, whose answers keep their indices: a run that adds written prompts to an earlier
    file-only run of the same --out answers only the new ones. A resumed run reads the written requests back."""
    from hyperdraft.training.samples import SELF_PROMPT_KINDS, self_prompt_requests

    requests = self_prompt_requests(len(SELF_PROMPT_KINDS) + 2)
    assert all(kind in r for kind, r in zip(SELF_PROMPT_KINDS * 2, requests))
    assert requests[len(SELF_PROMPT_KINDS)] == requests[0]

    train_draft(_config(target, tmp_path, prompts_file, epochs=1))
    file_only = SampleStore(str(tmp_path / "samples.jsonl")).done
    assert sorted(file_only) == list(range(len(PROMPTS)))
    os.remove(tmp_path / "checkpoint.pt")  # a new run over the same answers, not a resume
    train_draft(_config(target, tmp_path, prompts_file, epochs=1, self_prompts=3))
    rows = [json.loads(line) for line in open(tmp_path / "self_prompts.jsonl")]
    assert rows[0] == {"asked": {"count": 3, "seed": 0}}  # what they were written for
    written = [row["prompt"] for row in rows[1:]]
    assert len(written) == 3 and len(set(written)) == 3
    store = SampleStore(str(tmp_path / "samples.jsonl")).done
    assert sorted(store) == list(range(len(PROMPTS) + 3))
    assert all(store[i] == file_only[i] for i in range(len(PROMPTS)))  # the file's answers were not redone
    assert [store[len(PROMPTS) + i][0] for i in range(3)] == written
    state = torch.load(str(tmp_path / "checkpoint.pt"), weights_only=False)
    assert len(state["samples"]) == sum(s is not None for _, s in store.values())
    os.remove(tmp_path / "checkpoint.pt")  # more written prompts took the file's 3 without a word
    with pytest.raises(ValueError, match=r"self_prompts.jsonl holds prompts written for \{'count': 3, 'seed': 0\}, "
                                         r"this run asks \{'count': 5"):
        train_draft(_config(target, tmp_path, prompts_file, epochs=1, self_prompts=5))


def test_written_prompts_need_a_prompts_file(target, tmp_path):
    with pytest.raises(ValueError, match="self_prompts"):
        train_draft(_config(target, tmp_path, None, self_prompts=2))
    with pytest.raises(ValueError, match="self_prompts must be >= 0"):
        train_draft(_config(target, tmp_path, "p.jsonl", self_prompts=-1))


def test_the_engine_accepts_what_training_measured(trained, target):
    """Training's agreement is the acceptance the engine gets: on each prompt's greedy answer, the chain rounds the
    unroll predicts (its drafts against the answer) are the rounds the engine runs, round count and accepted drafts
    both. Catches any drift between how the head is trained and how it drafts (positions, the K/V the head keeps
    for accepted tokens, which target states feed it)."""
    steps = 3
    plain = LLM(target, device="cpu", dtype="float32")
    llm = LLM(target, device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
              speculative_draft_model_path=trained, speculative_num_steps=steps, speculative_eagle_topk=1,
              speculative_num_draft_tokens=steps + 1)
    prompts = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    rows = compare_rounds(plain, llm, *load_target_and_head(target, trained), prompts, steps, new_tokens=24)
    assert all(row.output_equal and row.engine == row.unroll for row in rows), rows
    assert sum(row.unroll[1] for row in rows) > len(PROMPTS)  # rounds with accepted drafts compared, not only misses
    assert_engine_clean(llm)


def test_init_starts_a_new_run_from_a_published_head(trained, target, prompts_file, tmp_path):
    # lr 1e-12: one epoch moves no weight measurably, so the new run's head is the --init head, not a new one
    train_draft(_config(target, tmp_path, prompts_file, epochs=1, lr=1e-12, init=trained))
    before, after = load_file(os.path.join(trained, "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], atol=1e-8, rtol=0, msg=name)
    with open(os.path.join(trained, "config.json")) as f, open(tmp_path / "config.json") as g:
        assert json.load(f) == json.load(g)


def test_init_refuses_what_the_head_fixes_and_resume(trained, target, prompts_file, tmp_path):
    for kw, match in ((dict(aux_layer_ids=(0, 2, 4)), r"aux_layer_ids \[0, 2, 4\] differs from the --init head's"),
                      (dict(draft_vocab_size=100), "draft_vocab_size 100 differs from the --init head's 200"),
                      (dict(head_intermediate_size=256), "head_intermediate_size 256 differs from the --init"),
                      (dict(resume=True), "init starts a new run from a published head, resume continues")):
        with pytest.raises(ValueError, match=match):
            train_draft(_config(target, tmp_path, prompts_file, epochs=1, init=trained, **kw))
    assert not os.listdir(tmp_path)  # refused before anything was answered or written
    eagle1 = write_random_eagle_checkpoint(str(tmp_path.parent / "eagle1"), target, kind="eagle")
    with pytest.raises(ValueError, match="is a LlamaForCausalLMEagle head; train-draft trains EAGLE-3 heads"):
        train_draft(_config(target, tmp_path, prompts_file, epochs=1, init=eagle1))


def test_cli_passes_init(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(trainer, "train_draft", lambda cfg: seen.append(cfg) or {})
    assert cli_main(["train-draft", "--model", "m", "--out", str(tmp_path), "--init", "/heads/h24"]) == 0
    assert seen[0].init == "/heads/h24" and not seen[0].resume


def test_the_hard_label_weight_mixes_the_two_losses(trained, target):
    """The batch loss is linear in hard_label_weight (loss.py): w = 0.5 is the mean of w = 0 and w = 1, and w = 1 is
    another loss, so the weight reaches every step's term."""
    model, head = load_target_and_head(target, trained)
    gen = torch.Generator().manual_seed(5)
    samples = [Sample(torch.randint(0, 384, (n,), generator=gen).tolist(), start) for n, start in ((30, 4), (41, 9))]
    with torch.no_grad():
        soft, half, hard = (_batch_loss(samples, model, head, head.draft_to_target, 3, w)[0] for w in (0.0, 0.5, 1.0))
    torch.testing.assert_close(half, (soft + hard) / 2, rtol=1e-5, atol=1e-6)
    assert abs(float(hard - soft)) > 1e-3


def test_cli_passes_the_hard_label_weight(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(trainer, "train_draft", lambda cfg: seen.append(cfg) or {})
    assert cli_main(["train-draft", "--model", "m", "--out", str(tmp_path), "--hard-label-weight", "0.3"]) == 0
    assert cli_main(["train-draft", "--model", "m", "--out", str(tmp_path)]) == 0
    assert [c.hard_label_weight for c in seen] == [0.3, 0.0]


def test_a_run_whose_answers_are_stored_starts_no_engine(trained, target, prompts_file, tmp_path, monkeypatch):
    """A new run (--init) on an earlier run's answers, copied into its --out: every prompt is read back from the
    store, so no engine starts (none claims a K/V cache beside the training), and the run trains on those answers."""
    import shutil

    import hyperdraft.llm

    shutil.copy(os.path.join(trained, "samples.jsonl"), tmp_path / "samples.jsonl")

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started for answers that were stored")

    monkeypatch.setattr(hyperdraft.llm.LLM, "__init__", refuse)
    metrics = train_draft(_config(target, tmp_path, prompts_file, epochs=1, init=trained))
    assert metrics["epoch"] == 1 and os.path.isfile(tmp_path / "model.safetensors")


def test_a_head_trained_with_hard_labels_drafts_losslessly(trained, target, prompts_file, tmp_path):
    """Two more epochs from the trained head with all of the loss on the target's argmax, then EAGLE3 with it: greedy
    and sampled (seeded) outputs equal speculation off, and the K/V pool is free after."""
    train_draft(_config(target, tmp_path, prompts_file, epochs=2, init=trained, hard_label_weight=1.0))
    llm_off = LLM(target, device="cpu", dtype="float32")
    prompts = [llm_off.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:4]]
    runs = [SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=24, ignore_eos=True)]
    want = [[o.token_ids for o in llm_off.generate(input_ids=prompts, sampling_params=p, use_tqdm=False)] for p in runs]
    llm = LLM(target, device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
              speculative_draft_model_path=str(tmp_path), speculative_num_steps=3)
    got = [[o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=p, use_tqdm=False)] for p in runs]
    assert got[0] == want[0]
    assert got[1] == want[1]  # seeded sampling is coupled to the target's draws (the default verification)
    assert llm.get_server_info()["internal_states"][0]["spec_accepted_tokens"] > 0
    assert_engine_clean(llm)


def test_init_refuses_a_head_whose_d2t_does_not_ascend(trained, target, prompts_file, tmp_path):
    """train-draft's draft vocabulary is ascending target ids (its searches rely on it); a published head from
    elsewhere may order its d2t otherwise, and is refused by name before anything is answered."""
    import shutil

    from safetensors.torch import save_file

    other = tmp_path / "other"
    shutil.copytree(trained, other)
    tensors = load_file(str(other / "model.safetensors"))
    ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"]
    ids[[0, 1]] = ids[[1, 0]]  # the same ids, two of them swapped
    tensors["d2t"] = ids - torch.arange(ids.numel())
    save_file(tensors, str(other / "model.safetensors"))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"init: .*other's d2t: the draft vocabulary's target ids must ascend"):
        train_draft(_config(target, out, prompts_file, epochs=1, init=str(other)))
    assert not out.exists()
