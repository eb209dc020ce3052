"""Tokenizer built from GGUF metadata equals transformers' tokenizer of the same GGUF; the stream
decoder never emits a broken UTF-8 character and its deltas add up to decode(all)."""

from __future__ import annotations

import pytest

TEXTS = [
    "Hello, world! How are you today?",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Numbers: 1234567 and 3.14159, year 2024.",
    "Emoji 👍🏽🎉 and Korean 안녕하세요, 세계! Accents: café naïve façade.",
    "def f(x):\n\treturn x  *  2   # spaces\n\n\n",
    "中文和日本語のテキスト",
    "<|endoftext|>tail text<|im_end|>",
]


@pytest.fixture(scope="module")
def oracle(hf_smollm_tokenizer):
    """transformers' tokenizer of the GGUF with the model's own pre-tokenizer restored.

    transformers' GGUF converter has no entry for tokenizer.ggml.pre == "smollm" and falls back to
    plain GPT-2 splitting; llama.cpp (the GGUF's owner) and SmolLM2's tokenizer.json first split
    every digit off (\\p{N}), then apply the GPT-2 split. Vocabulary, merges and special tokens stay
    transformers' own.
    """
    from tokenizers import Tokenizer, pre_tokenizers

    tok = Tokenizer.from_str(hf_smollm_tokenizer.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(smollm, oracle, text):
    ours = smollm.tokenizer.encode(text)
    assert ours == oracle.encode(text, add_special_tokens=False).ids
    assert smollm.tokenizer.decode(ours) == text


def test_encode_equals_unpatched_transformers_without_digits(smollm, hf_smollm_tokenizer):
    for text in (t for t in TEXTS if not any(c.isdigit() for c in t)):
        assert smollm.tokenizer.encode(text) == hf_smollm_tokenizer.encode(text, add_special_tokens=False)


def test_special_tokens_and_digits(smollm):
    tok = smollm.tokenizer
    assert tok.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tok.eos_token_ids == (2,)
    digits = tok.encode("2024")
    assert len(digits) == 4 and tok.decode(digits[:1]) == "2"  # SmolLM splits numbers into digits
    assert [tok.decode([i]) for i in tok.encode("x  2")] == ["x", "  ", "2"]  # as llama.cpp splits


def test_chat_template_equals_transformers(smollm, hf_smollm_tokenizer):
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Tell me a joke."}]  # fmt: skip
    ours = smollm.tokenizer.apply_chat_template(messages)
    ref = hf_smollm_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", [TEXTS[3], TEXTS[5], "🎉🎉🎉 한국어 텍스트 스트리밍 테스트 ✓ ok"])
def test_stream_decoder_never_breaks_characters(smollm, text):
    tok = smollm.tokenizer
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    deltas = [dec.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some token ended mid-character and was held back
    assert "".join(deltas) + dec.flush() == tok.decode(ids) == text


def test_stream_decoder_keeps_spaces_and_flushes_partial_tail(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("  two  spaces, then   three and a trailing space ")
    dec = tok.stream_decoder()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids)
    partial = tok.encode("👍")[:-1]  # an emoji cut short: nothing is emitted until flush
    dec = tok.stream_decoder()
    assert [dec.push(i) for i in partial] == [""] * len(partial)
    assert dec.flush() == tok.decode(partial)


def test_load_tokenizer_reads_no_weights(smollm):
    from rngd_pd.model import load_tokenizer

    config, tok = load_tokenizer()
    assert config == smollm.config
    assert tok.encode(TEXTS[1]) == smollm.tokenizer.encode(TEXTS[1])


def test_gguf_add_bos_token_prepends_bos_like_hf():
    from rngd_pd.model.tokenizer import Tokenizer, tokenizer_from_gguf

    bpe = tokenizer_from_gguf(["<s>", "a", "b", "ab"], ["a b"], [3, 1, 1, 1], "default", "gpt2", bos_id=0)
    tok = Tokenizer(bpe, (0,))
    assert tok.encode("ab") == [0, 3]
    assert tok.encode("<s>ab", add_special_tokens=False) == [0, 3]
    assert tok.decode([0, 3]) == "<s>ab" and tok.decode([0, 3], skip_special_tokens=True) == "ab"
