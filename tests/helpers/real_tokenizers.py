"""Real tokenizers for text tests: SmolLM2's byte-level BPE, a Llama-2-style Metaspace BPE (its decoder strips a
window's leading space) and a byte-fallback SentencePiece-style one (Llama 2 / Mistral), as module fixtures."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEXT = ("Le café coûte 3,50 € — très cher! 東京は大きい。 The fox 🦊 jumps over the lazy dog 🐶, twice: "
        "fox fox. Ω ≈ 2π; naïve coöperation. ") * 3


@pytest.fixture(scope="module")
def smollm2():
    from hyperdraft.models.default_model import ensure_default_model
    from hyperdraft.models.loader import load_tokenizer

    tok = load_tokenizer(ensure_default_model(progress=False))
    assert isinstance(tok, PreTrainedTokenizerFast) and not tok.clean_up_tokenization_spaces  # the one-decode path
    return tok


@pytest.fixture(scope="module")
def metaspace():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"],
                                                             show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
    assert fast.decode(fast.encode("the fox", add_special_tokens=False)) == "the fox"
    return fast


@pytest.fixture(scope="module")
def byte_fallback():
    """Llama 2 / Mistral style: a few words, every other character spelled as <0xNN> byte tokens, and a decoder
    that turns a run of byte tokens that is not valid UTF-8 into U+FFFD, the whole run."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update((f"<0x{i:02X}>", 4 + i) for i in range(256))
    for word in ["▁", "x", "▁Hello", "▁world", "▁fox", "o", "▁w"]:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)
    assert fast.decode(fast.encode("x日本😀\n", add_special_tokens=False)) == "x日本😀\n"
    return fast
