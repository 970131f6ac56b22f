"""IncrementalDetokenizer with the tiny byte-level BPE tokenizer: no half characters, no part of a stop string."""

from __future__ import annotations

import random

import pytest

from hyperdraft.detokenizer import IncrementalDetokenizer
from helpers.real_tokenizers import TEXT, byte_fallback, metaspace, smollm2  # noqa: F401 (fixtures)

MULTIBYTE = "你好，世界。🙂🚀 naïve café Ω𝄞 ünïcödé 好"
ASCII = "The quick brown fox jumps over the lazy dog. The quick brown fox! lolololoB the end"


@pytest.fixture(scope="module")
def tok(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


def _push_all(detok, ids, chunk: int = 1, final: bool = True) -> list[str]:
    """Push ids in chunks; return the deltas (the last push is final)."""
    deltas = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        deltas.append(detok.push(ids[i:i + chunk], final=final and last))
    return deltas


def test_multibyte_text_is_really_split_across_tokens(tok):
    ids = tok.encode(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    # The test below is only meaningful if single tokens carry half characters.
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 10


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_multibyte_never_emits_replacement_char(tok, chunk):
    ids = tok.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(tok, [])
    deltas = _push_all(detok, ids, chunk)
    for d in deltas:
        assert "\ufffd" not in d
    assert "".join(deltas) == MULTIBYTE == detok.text
    # Text is emitted as soon as a character completes, not only at the end.
    assert sum(1 for d in deltas if d) >= len(deltas) // 2


def test_emoji_alone_waits_for_its_last_byte(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🙂"


def test_incomplete_character_flushed_when_final(tok):
    ids = tok.encode("ab🙂")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(ids[:-1]) == "ab"
    # The request ended mid-character: the final push emits what the tokenizer decodes, replacement char included.
    assert detok.push([], final=True) == tok.decode(ids[:-1])[2:]
    assert detok.text.endswith("\ufffd")


def _check_stop_stream(tok, text: str, stop: list[str], chunk: int) -> str:
    ids = tok.encode(text)
    cut = min(i for i in (text.find(s) for s in stop) if i >= 0)
    expect = text[:cut]
    detok = IncrementalDetokenizer(tok, stop)
    emitted = ""
    for i in range(0, len(ids), chunk):
        emitted += detok.push(ids[i:i + chunk])
        # Never a partial stop string (or anything past it): what is out is always a prefix of the final text.
        assert expect.startswith(emitted), f"emitted {emitted!r} is not a prefix of {expect!r}"
        assert not any(s in emitted for s in stop)
        # Liveness: at most a stop string's length minus one (plus a half character) is held back.
        so_far = tok.decode(ids[:i + chunk])
        if not any(s in so_far for s in stop):
            held = so_far.rstrip("\ufffd")[len(emitted):]
            assert len(held) <= max(len(s) for s in stop) - 1, f"holding back {held!r}"
    emitted += detok.push([], final=True)
    assert emitted == expect == detok.text
    return emitted


@pytest.mark.parametrize("chunk", [1, 2, 4])
@pytest.mark.parametrize("stop", [["fox!"], ["lazy dog"], ["loB"], ["ololoB"], ["the end"], [" ", "x"],
                                  ["zzz", "brown fox! l", "quick"]])
def test_stop_string_never_partly_emitted(tok, stop, chunk):
    _check_stop_stream(tok, ASCII, stop, chunk)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("stop", [["世界"], ["好，"], ["🚀"], ["ï"], ["Ω𝄞 ü"], ["é 好"]])
def test_multibyte_stop_string(tok, stop, chunk):
    out = _check_stop_stream(tok, MULTIBYTE, stop, chunk)
    assert "\ufffd" not in out


def test_false_start_of_stop_string_is_released(tok):
    """'fox' could start 'fox!' and is held back, then released once ' jumps' shows it was not the stop string."""
    ids = tok.encode("The quick brown fox jumps")
    detok = IncrementalDetokenizer(tok, ["fox!"])
    n_fox = next(n for n in range(len(ids) + 1) if tok.decode(ids[:n]).endswith("fox"))
    out = "".join(detok.push([i]) for i in ids[:n_fox])
    assert out == "The quick brown "
    out += "".join(detok.push([i]) for i in ids[n_fox:])
    assert out == "The quick brown fox jumps"


def test_stop_string_completed_within_one_push(tok):
    detok = IncrementalDetokenizer(tok, ["brown"])
    assert detok.push(tok.encode("The quick brown fox")) == "The quick "
    assert detok.push(tok.encode(" jumps"), final=True) == ""
    assert detok.text == "The quick "


def test_special_tokens(tok):
    ids = tok.encode("Hello") + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(_push_all(skip, ids)) == "Hello"
    assert "".join(_push_all(keep, ids)) == "Hello" + tok.eos_token


def test_without_tokenizer_emits_nothing():
    detok = IncrementalDetokenizer(None, ["x"])
    assert detok.push([1, 2, 3], final=True) == "" and detok.text == ""
    assert detok.ids == [1, 2, 3]


class _CountingTokenizer:
    """The real tokenizer, counting how many ids each decode is given."""

    def __init__(self, tok):
        self.tok, self.ids_decoded = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.ids_decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_push_costs_the_same_however_long_the_output(tok):
    """Decoding the whole output at every push is O(n^2) over a request; the window keeps it O(n), with the text
    still equal to the whole output's decode (long mixed text, pushed in chunks of 1..4 tokens)."""
    text = (ASCII + " " + MULTIBYTE + " ") * 40
    ids = tok.encode(text)
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, ["never appears"])
    out, i, sizes = "", 0, [1, 3, 2, 4]
    while i < len(ids):
        n = sizes[i % 4]
        out += detok.push(ids[i:i + n], final=i + n >= len(ids))
        i += n
    assert out == tok.decode(ids) == detok.text
    assert len(ids) > 1000 and counting.ids_decoded < 12 * len(ids), counting.ids_decoded


def test_a_step_of_many_requests_decodes_as_each_alone(tok, monkeypatch):
    """push_all (one batched decode per step, through the Rust tokenizer) gives every request the deltas its own
    pushes give: multibyte text split mid-character, stop strings, special tokens skipped or kept, requests
    finishing at different steps. The batch is one backend call per (tokenizer, skip_special_tokens) per step."""
    from hyperdraft import detokenizer

    assert isinstance(tok, detokenizer.PreTrainedTokenizerFast) and not tok.clean_up_tokenization_spaces
    texts = [MULTIBYTE, ASCII, MULTIBYTE[::-1], ASCII + MULTIBYTE, "ab", ASCII[:30]]
    stops = [[], ["lazy"], ["🙂"], ["é ü"], [], ["fox"]]
    ids = [tok.encode(t) + ([tok.eos_token_id] if i % 2 else []) for i, t in enumerate(texts)]
    skips = [True, False, True, True, False, True]
    chunks = [1, 2, 3, 1, 4, 2]

    def run(batched: bool) -> list[list[str]]:
        detoks = [IncrementalDetokenizer(tok, s, skip) for s, skip in zip(stops, skips)]
        deltas: list[list[str]] = [[] for _ in texts]
        for step in range(max(-(-len(x) // c) for x, c in zip(ids, chunks))):
            live = [i for i in range(len(texts)) if step * chunks[i] < len(ids[i])]
            pushes = [(detoks[i], ids[i][step * chunks[i]:(step + 1) * chunks[i]],
                       (step + 1) * chunks[i] >= len(ids[i])) for i in live]
            out = detokenizer.push_all(pushes) if batched else [d.push(n, final=f) for d, n, f in pushes]
            for i, text in zip(live, out):
                deltas[i].append(text)
        return deltas

    alone = run(batched=False)
    calls = []
    original = detokenizer.decode_many
    monkeypatch.setattr(detokenizer, "decode_many", lambda *a: calls.append(len(a[1])) or original(*a))
    assert run(batched=True) == alone
    assert max(calls) > 4 and len(calls) <= 2 * max(-(-len(x) // c) for x, c in zip(ids, chunks))
    assert "".join(alone[0]) == MULTIBYTE and "".join(alone[1]) == ASCII[:ASCII.index("lazy")]


def test_decode_many_equals_decode(tok):
    seqs = [tok.encode(MULTIBYTE)[3:17], tok.encode(ASCII), [tok.eos_token_id, *tok.encode("hi")], []]
    from hyperdraft.detokenizer import decode_many

    for skip in (True, False):
        assert decode_many(tok, seqs, skip) == [tok.decode(s, skip_special_tokens=skip) for s in seqs]


def _longest_partial_stop(text: str, stop: list[str]) -> int:
    return max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@pytest.mark.parametrize("seed", range(4))
def test_exactly_the_longest_partial_stop_is_held_back(tok, seed):
    """Random stop lists over a four-character alphabet (overlapping prefixes, repeats, one string the prefix of
    another): after every token, what is held back is exactly the longest end of the text that a stop string could
    still grow from, never more (the skipped candidates of the scan) and never less."""
    rng = random.Random(seed)
    pick = lambda n: "".join(rng.choice("ab c") for _ in range(n))  # noqa: E731
    for _ in range(25):
        stop = [pick(rng.randint(1, 7)) for _ in range(rng.randint(1, 5))]
        text = pick(48)
        ids = tok.encode(text)
        detok, emitted = IncrementalDetokenizer(tok, stop), ""
        for n in range(len(ids)):
            emitted += detok.push(ids[n:n + 1])
            so_far = tok.decode(ids[:n + 1])
            if any(s in so_far for s in stop):
                break
            assert so_far.startswith(emitted)
            assert len(so_far) - len(emitted) == _longest_partial_stop(so_far, stop), (stop, so_far, emitted)


def test_token_bytes_of_characters_split_across_tokens(tok):
    """OpenAI's logprobs give each token's UTF-8 bytes; a token holding part of a character decodes to U+FFFD alone,
    and its bytes used to be null: its raw bytes come from the byte-level piece, and a text's tokens' bytes join to
    the text's UTF-8."""
    from hyperdraft.detokenizer import token_bytes

    ids = tok.encode(MULTIBYTE)
    parts = [token_bytes(tok, i, tok.decode([i])) for i in ids]
    assert all(p is not None for p in parts) and sum("\ufffd" in tok.decode([i]) for i in ids) >= 10
    assert bytes(b for p in parts for b in p) == MULTIBYTE.encode()


def test_token_bytes_of_sentencepiece_byte_fallback_tokens():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from hyperdraft.detokenizer import token_bytes

    vocab = {"<unk>": 0, **{f"<0x{i:02X}>": 1 + i for i in range(256)}, "x": 257}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    ids = fast.encode("x日", add_special_tokens=False)
    assert [token_bytes(fast, i, fast.decode([i])) for i in ids] == [[ord("x")], *[[b] for b in "日".encode()]]


@pytest.mark.parametrize("seed", range(6))
def test_random_chunks_and_stops_over_split_characters(tok, seed):
    """Mixed multi-byte text in random chunks, with stop strings cut from the text itself (so they start in the
    middle of characters' byte runs, after text emitted ahead of the settled window): the deltas join to the text
    before the first stop, every one a continuation of the last; a mark/rewind in the middle replays the same."""
    rng = random.Random(seed)
    text = "".join(rng.choice([MULTIBYTE, ASCII, "🙂🚀Ω", " ab"]) for _ in range(6))
    ids = tok.encode(text)
    at = rng.randrange(len(text) // 2, len(text) - 3)
    stop = [text[at:at + rng.randint(1, 3)], "never here"]
    cut = min(i for i in (text.find(s) for s in stop) if i >= 0)
    detok, emitted, i, marked = IncrementalDetokenizer(tok, stop), "", 0, None
    mark_at = rng.randrange(len(ids) // 4)  # before the stop: it starts in the text's second half
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, 4)
        if marked is None and i >= mark_at:
            marked = (detok.mark(), i, emitted)
        emitted += detok.push(ids[i:i + n], final=i + n >= len(ids))
        assert text[:cut].startswith(emitted), (emitted, text[:cut])
        i += n
    emitted += detok.push([], final=True)
    assert emitted == text[:cut] == detok.text
    state, i, again = marked
    detok.rewind(state)
    detok.stopped = False
    while i < len(ids) and not detok.stopped:
        again += detok.push(ids[i:i + 2], final=i + 2 >= len(ids))
        i += 2
    again += detok.push([], final=True)
    assert again == text[:cut] == detok.text


@pytest.mark.parametrize("name", ["smollm2", "metaspace", "byte_fallback"])
def test_the_output_reads_as_the_prompt_continued(name, request):
    """The text is what decoding prompt + output gives past the prompt's own text, as SGLang and vLLM give it: a
    Metaspace decoder strips a window's leading space, so an output decoded alone lost its first space. Random
    splits of real text into prompt and output, pushed in random chunks, with a stop string half the time."""
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    rng, checked = random.Random(7), 0
    for case in range(300):
        split = rng.randrange(1, len(ids) - 20)
        prompt, output = ids[max(0, split - rng.randint(1, 30)):split], ids[split:split + rng.randint(1, 20)]
        before = tokenizer.decode(prompt)
        whole = tokenizer.decode(prompt + output)
        if before.endswith("\ufffd") or whole.endswith("\ufffd") or not whole.startswith(before):
            continue  # a prompt or an output ending inside a character (a byte-fallback decode of the whole then
            # turns its entire run of byte tokens into U+FFFD): no reference text to compare with
        want = whole[len(before):]
        stop = [want[rng.randrange(len(want)):][:3]] if rng.random() < 0.5 and want.strip() else []
        detok = IncrementalDetokenizer(tokenizer, stop, prompt_ids=prompt)
        got = "".join(_push_all(detok, output, chunk=rng.randint(1, 4)))
        assert got == (want[:want.find(stop[0])] if stop else want), (case, prompt, output, stop)
        assert detok.num_output_ids == len(output) or detok.stopped
        checked += 1
    assert checked > 150


def test_offline_text_of_a_sentencepiece_model_keeps_its_first_space(metaspace, tmp_path, make_llm):
    """End to end, LLM.generate and LLM.stream on a tiny model with the Metaspace tokenizer: each answer's text is
    decode(prompt + answer) past the prompt's own text, so an answer starting with a "▁" piece starts with a space
    (it started with the word before)."""
    from hyperdraft import SamplingParams
    from hyperdraft.testing.tiny import make_tiny_model

    path = str(tmp_path / "sp")
    make_tiny_model(path, "llama", with_tokenizer=False, vocab_size=len(metaspace), eos_token_id=metaspace.eos_token_id)
    metaspace.save_pretrained(path)
    llm = make_llm(path)
    prompts = ["The fox jumps", "Le café", "twice: fox", "naïve"]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    streamed = [""] * len(prompts)
    for delta in llm.stream(prompts, params):
        streamed[delta.index] += delta.text
    spaced = 0
    for prompt, out, text in zip(prompts, outs, streamed):
        ids = metaspace.encode(prompt)
        want = metaspace.decode(ids + out.token_ids, skip_special_tokens=True)[len(metaspace.decode(ids)):]
        assert out.text == text == want, (prompt, out.token_ids)
        spaced += metaspace.convert_ids_to_tokens(out.token_ids[0]).startswith("▁")
    assert spaced > 0  # some answer starts with a "▁" piece, where decoding it alone strips the space


@pytest.mark.parametrize("name", ["smollm2", "metaspace", "byte_fallback"])
def test_logprob_token_texts_add_up_to_the_text(name, request):
    """OpenAI's logprob tokens and text_offset: each token's text as it reads after the one before it, so they add up
    to the answer's text (a Metaspace piece decoded alone lost its leading space), wherever no character is split."""
    from hyperdraft.detokenizer import token_texts

    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    rng, checked = random.Random(3), 0
    for _ in range(200):
        split = rng.randrange(1, len(ids) - 12)
        prompt, answer = ids[split - 1:split], ids[split:split + rng.randint(1, 12)]
        pieces = token_texts(tokenizer, answer, prompt[-1])
        if any("\ufffd" in tokenizer.decode(answer[:k + 1]) for k in range(len(answer))) or \
                "\ufffd" in tokenizer.decode(prompt):
            continue  # a split character: its pieces are U+FFFD by design
        before = tokenizer.decode(prompt)
        assert "".join(pieces) == tokenizer.decode(prompt + answer)[len(before):], (prompt, answer, pieces)
        checked += 1
    assert checked > 50
