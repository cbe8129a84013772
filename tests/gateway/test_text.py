"""The gateway's text pieces (``gateway_service.text``): the incremental detokenizer, the backend
decode, and the stop-string matcher."""

from __future__ import annotations

from gateway_service.text import IncrementalDetokenizer, StopStringMatcher


def test_detokenizer_never_emits_a_broken_character_and_joins_to_decode(hf_tokenizer):
    text = "naïve café — 東京タワー 🚀 done"
    ids = hf_tokenizer.encode(text)
    prompt = hf_tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(hf_tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert any(p == "" for p in pieces)  # a multi-byte character spans tokens and was held back


def test_the_backend_decode_gives_what_the_tokenizers_decode_gives(hf_tokenizer):
    import random

    from gateway_service.text import backend_decode

    fast = backend_decode(hf_tokenizer)
    assert fast is not None  # SmolLM2's tokenizer is a fast one without space clean-up
    rng = random.Random(0)
    specials = list(hf_tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(hf_tokenizer))
               for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)

    class Slow:  # a tokenizer that cleans up spaces (or has no backend) keeps its own decode
        clean_up_tokenization_spaces = True
        backend_tokenizer = hf_tokenizer.backend_tokenizer
    assert backend_decode(Slow()) is None and backend_decode(object()) is None


def test_the_backend_encode_gives_what_the_tokenizers_encode_gives(hf_tokenizer):
    import random

    from gateway_service.text import PromptTokenizer, backend_encode

    fast = backend_encode(hf_tokenizer)
    assert fast is not None  # SmolLM2's tokenizer is transformers' fast one, its encode path unchanged
    rng = random.Random(1)
    specials = [hf_tokenizer.decode([i]) for i in hf_tokenizer.all_special_ids]
    texts = ["", " ", "  leading and trailing  ", "naïve café — 東京タワー 🚀\n\n\ttabs", "<|im_start|>user\nhi<|im_end|>",
             "\u200b\ufeff zero width", "a" * 5000]
    for _ in range(200):  # random ids decoded (vLLM's random prompts), special tokens' text among them
        ids = [rng.randrange(len(hf_tokenizer)) for _ in range(rng.randrange(1, 80))]
        text = hf_tokenizer.decode(ids)
        if rng.random() < 0.3:
            text = rng.choice(specials).join([text, text[: rng.randrange(len(text) + 1)]])
        texts.append(text)
    prompts = PromptTokenizer(hf_tokenizer)
    for text in texts:
        for special in (True, False):
            expected = list(hf_tokenizer.encode(text, add_special_tokens=special))
            assert fast(text, special) == expected, text
            assert prompts.encode_text(text, add_special_tokens=special) == expected

    # a backend left truncating (by a call elsewhere): the plain encode path, which resets it
    hf_tokenizer.backend_tokenizer.enable_truncation(4)
    try:
        assert fast("one two three four five six", True) is None
        assert prompts.encode_text("one two three four five six") == list(hf_tokenizer.encode("one two three four five six"))
    finally:
        hf_tokenizer.backend_tokenizer.no_truncation()
    # special tokens split later (the tokenizer's own switch): the plain path, which follows it
    hf_tokenizer.split_special_tokens = True
    try:
        assert fast("<|im_start|>user", True) is None
        assert prompts.encode_text("<|im_start|>user") == list(hf_tokenizer.encode("<|im_start|>user"))
    finally:
        hf_tokenizer.split_special_tokens = False
        hf_tokenizer.encode("")  # the backend follows the switch at transformers' next call
    assert fast("<|im_start|>user", True) == list(hf_tokenizer.encode("<|im_start|>user"))
    assert backend_encode(object()) is None


def test_stop_matcher_holds_back_possible_stop_prefixes():
    m = StopStringMatcher(("STOP", "\n\n"))
    assert m.feed("hello S") == ("hello ", None)
    assert m.feed("T") == ("", None)
    assert m.feed("x") == ("STx", None)  # not a stop after all: released
    assert m.feed(" end\n") == (" end", None)
    assert m.feed("\nmore") == ("", "\n\n")


def test_stop_matcher_finds_the_earliest_stop_and_drops_the_rest():
    m = StopStringMatcher(("world", "lo"))
    assert m.feed("hello world") == ("hel", "lo")
