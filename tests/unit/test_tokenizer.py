"""Incremental detokenization concatenates to the whole-sequence decode, never broken UTF-8;
chat templates render as transformers renders them, in a sandbox."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tokenizer_svc.tokenizer import ChatTemplateError, IncrementalDetokenizer, TextTokenizer, TokenizerInputError

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "naïve café — 東京は日本の首都です 🙂🚀 done",
    "  leading spaces and\ttabs\nnew lines  ",
]
SP_TEXTS = [" the fox  jumps", "東京 the 🙂 dog\nend", "hello world", "  the  lazy\n\ndog 🚀"]
SP_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "a naive cafe in the town"]


@pytest.fixture(scope="module")
def tok(default_model):
    return TextTokenizer(default_model)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Push ``ids`` in chunks of 1..3, then flush."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_in_chunks_concatenate_to_full_decode(tok, skip):
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        deltas = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, rng)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_text_before_an_unfinished_character_is_not_held_back(tok):
    ids = tok.encode("Hi 🚀")  # "Hi", then the rocket's four bytes over three tokens
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == "Hi"
    assert detok.push(ids[-1:]) == " 🚀"
    assert detok.flush() == ""


def _sentencepiece_json(style: str) -> str:
    """A Llama-2 ("strip": Replace/ByteFallback/Fuse/Strip) or Metaspace-style BPE with byte fallback."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    if style == "metaspace":
        base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    else:
        base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    base.train_from_iterator(SP_CORPUS * 10, trainer)
    spec = json.loads(base.to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for t, i in learned if i < 3} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {t: 259 + n for n, (t, _) in enumerate(learned[3:])}
    spec["model"].update(vocab=vocab, byte_fallback=True)
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    first = (decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True) if style == "metaspace"
             else decoders.Replace("▁", " "))
    tail = [] if style == "metaspace" else [decoders.Strip(" ", 1, 0)]
    tok.decoder = decoders.Sequence([first, decoders.ByteFallback(), decoders.Fuse(), *tail])
    return tok.to_str()


@pytest.fixture(scope="module", params=["strip", "metaspace"])
def sentencepiece(request, tmp_path_factory):
    """A SentencePiece-style model folder and transformers' tokenizer for it, the referee."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp(f"sp-{request.param}")
    (folder / "tokenizer.json").write_text(_sentencepiece_json(request.param))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"vocab_size": len(hf) + 8}))  # padded embedding rows
    return TextTokenizer(folder), hf


def test_sentencepiece_leading_spaces_and_byte_fallback_match_transformers(sentencepiece):
    tok, hf = sentencepiece
    assert len(tok.byte_fallback_ids) == 256
    rng = random.Random(5)
    for text in SP_TEXTS * 3:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = stream(IncrementalDetokenizer(tok), ids, rng)
        assert "".join(deltas) == hf.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_random_ids_match_transformers(sentencepiece, skip):
    """Random ids mix byte tokens, special tokens, padding ids and words: the decoder's hardest inputs."""
    tok, hf = sentencepiece
    rng = random.Random(6)
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, rng)
        assert "".join(deltas) == hf.decode(ids, skip_special_tokens=skip)


def test_model_facts(tok, default_model, tmp_path):
    assert (tok.vocab_size, tok.eos_token_ids, tok.has_chat_template) == (49152, (2,), True)
    shutil.copy(default_model / "tokenizer.json", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 49280}))  # padded rows
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    other = TextTokenizer(tmp_path)
    assert (other.eos_token_ids, other.has_chat_template, other.vocab_size) == ((2, 0, 1), False, 49280)
    other.check_ids([49279])
    assert other.decode([28120, 49279]) == "hello"  # padding rows decode to nothing
    with pytest.raises(ChatTemplateError, match="no chat template"):
        other.render_chat([{"role": "user", "content": "x"}])


def test_ids_outside_the_vocabulary_are_refused(tok):
    tok.check_ids([0, 49151])
    with pytest.raises(TokenizerInputError, match="token id 49152 is outside"):
        tok.check_ids([5, 49152, 70000])


def test_chat_template_renders_in_a_sandbox(tok):
    ids = tok.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system")
    tok.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        tok.render_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [([], "no messages"), ([{"role": "usr", "content": "x"}], "role 'usr'"), ([{"content": "x"}], "role None")],
)
def test_bad_messages_are_refused(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tok.render_chat(messages)


def test_template_features_of_transformers_are_available(default_model):
    tok = TextTokenizer(default_model)
    tok.chat_template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{% generation %}[{{ bos_token }}]{% endgeneration %}{{ strftime_now('%Y') | length }}"
        "{% if tools is none %}!{% endif %}"
    )
    rendered = tok.render_chat([{"role": "user", "content": "東京 <b>"}, {"role": "assistant", "content": "x"}])
    assert rendered == '{"role": "user", "content": "東京 <b>"}[<|im_start|>]4!'


def test_continue_final_message(tok):
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two, "}]
    assert tok.render_chat(messages, continue_final_message=True).endswith("<|im_start|>assistant\nOne, two, ")
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content | trim }}\n{% endfor %}"
    assert tok.render_chat(messages, continue_final_message=True) == "user: Count.\nassistant: One, two,"
    tok.chat_template = "{% for m in messages %}{{ m.role }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        tok.render_chat(messages, continue_final_message=True)


@pytest.fixture(autouse=True)
def _restore_template(tok):
    template = tok.chat_template
    yield
    tok.chat_template = template


def test_sentencepiece_fixture_is_realistic(sentencepiece):
    tok, hf = sentencepiece
    ids = tok.encode("東京 the", add_special_tokens=False)
    assert sum(i in tok.byte_fallback_ids for i in ids) == 6  # two CJK characters, three bytes each
    assert hf.decode(ids) == tok.decode(ids) == "東京 the"
