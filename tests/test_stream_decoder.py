"""StreamDecoder: the pieces add up to decode(all ids), and each push decodes a bounded window,
not the whole output (which made streaming quadratic in its length)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from runtime.tokenizer import StreamDecoder
from tests.tiny import SPECIAL_TOKENS, make_tokenizer


class CountingTokenizer:
    """BundleTokenizer's decode, recording how many ids each call was given."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.calls.append(len(ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _byte_level() -> Tokenizer:
    return make_tokenizer("a").backend_tokenizer


def _sentencepiece_style() -> Tokenizer:
    """Llama 2's decoder shape: ▁ for spaces, byte fallback, and the first space stripped."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "▁", "▁the", "▁cat", "▁sat", "a", "b", "ing", "▁a", ".", ",", "▁中", "文", "é", "▁é", "\n", "▁\n"]
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


def _random_ids(tokenizer: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """Any id for a byte-level vocabulary; for byte fallback, whole characters' byte tokens
    (a lone fallback byte is not decoded the same alone and inside a run of them)."""
    vocab = tokenizer.get_vocab()
    if "<0x00>" not in vocab:
        return [rng.randrange(tokenizer.get_vocab_size()) for _ in range(n)]
    plain = [i for token, i in vocab.items() if not token.startswith("<0x")]
    ids = []
    while len(ids) < n:
        if rng.random() < 0.2:
            ids += [vocab[f"<0x{b:02X}>"] for b in rng.choice("é中😀ß").encode("utf-8")]
        else:
            ids.append(rng.choice(plain))
    return ids


def _stream(decoder: StreamDecoder, tokenizer: CountingTokenizer, ids: list[int], rng: random.Random):
    """Pushes ids in random slices; returns the pieces and, per push, (ids decoded, bound):
    the window starts no earlier than the second-to-last push that returned text."""
    pieces, work, texted_at, at = [], [], [0, 0], 0
    while at < len(ids):
        size = rng.choice((0, 1, 1, 1, 2, 3, 5))
        tokenizer.calls.clear()
        piece = decoder.push(ids[at : at + size])
        at = min(at + size, len(ids))
        work.append((sum(tokenizer.calls), 2 * (at - texted_at[0])))
        if piece:
            texted_at = [texted_at[1], at]
        pieces.append(piece)
    return pieces, work


@pytest.mark.parametrize("build", [_byte_level, _sentencepiece_style], ids=["byte-level", "sentencepiece"])
def test_pieces_add_up_to_the_whole_decode_with_bounded_work_per_push(build):
    tokenizer = build()
    end = tokenizer.token_to_id("a") if tokenizer.token_to_id("a") is not None else tokenizer.encode("a").ids[0]
    rng = random.Random(7)
    for case in range(40):
        ids = _random_ids(tokenizer, rng, rng.randint(1, 300)) + [end]  # ends on a whole character
        counting = CountingTokenizer(tokenizer)
        pieces, work = _stream(StreamDecoder(counting), counting, ids, rng)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), case
        assert all(decoded <= bound for decoded, bound in work), (case, [w for w in work if w[0] > w[1]][:5])


def test_the_tiny_tokenizer_streams_text_as_decode_does():
    tokenizer = _byte_level()
    specials = [tokenizer.token_to_id(s) for s in SPECIAL_TOKENS]
    text = "the cat sat on the mat 中文 😀 — é\n  def f():\n\treturn 1"
    ids = tokenizer.encode(text).ids
    ids = ids[:5] + specials[:2] + ids[5:]
    counting = CountingTokenizer(tokenizer)
    decoder = StreamDecoder(counting)
    pieces = [decoder.push([i]) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert "\ufffd" not in "".join(pieces)  # a character split over tokens waits for its last byte
    assert len(ids) > 40 and sum(counting.calls) <= 4 * len(ids)  # the old decoder: len(ids)² / 2
