"""Tokenizer: encode/decode against transformers on a tokenizer trained here; special ids; streaming decode."""
from __future__ import annotations

import io
import json

import pytest

from exl2.errors import ModelLoadError
from exl2.generation.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "Tokenizers split text into pieces; decoders glue them back.",
    "Numbers like 12345 and 678 appear too, and so do   spaces.",
    "Café, naïve, résumé, déjà vu: accents matter.",
] * 10

TEXTS = [
    "Hello world!",
    "The lazy dog jumps over the quick fox 42 times.",
    "  leading spaces and trailing  ",
    "Café déjà vu, naïve résumé — ünïcödé",
    "CJK: 日本語のテキスト, 中文字符",
    "Emoji: 🤗🚀 👩‍👩‍👧 ok",
    "<|im_start|>user\nHi<|im_end|>\n",
    "line one\nline two\r\n\ttabbed",
]
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def _train_byte_bpe():
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    return tok


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    _train_byte_bpe().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}, "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}],
    }))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4], "bos_token_id": 0}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 1, "model_type": "llama"}))
    return d


@pytest.fixture(scope="module")
def hf_tok(bpe_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(bpe_dir))


def test_encode_decode_match_transformers(bpe_dir, hf_tok):
    tok = Tokenizer.from_dir(bpe_dir)
    for text in TEXTS:
        ours = tok.encode(text, add_bos=False)
        ref = hf_tok(text, add_special_tokens=False)["input_ids"]
        assert ours == ref, text
        # The model's rule (here: the post-processor adds <s>) matches transformers' add_special_tokens=True.
        assert tok.encode(text) == hf_tok(text, add_special_tokens=True)["input_ids"], text
        assert tok.decode(ours) == hf_tok.decode(ref) == text
        assert tok.decode(ours, skip_special=True) == hf_tok.decode(ref, skip_special_tokens=True)
    assert tok.vocab_size == len(hf_tok)
    assert [tok.id_to_piece(i) for i in range(len(SPECIALS))] == SPECIALS


def test_special_ids_and_template(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir)
    assert tok.bos_id == 0 and tok.pad_id == 2
    assert tok.eos_ids == {1, 4}  # tokenizer_config's </s> plus every id generation_config lists
    assert tok.chat_template == "DEFAULT"
    assert tok.special_tokens_map["eos_token"] == "</s>"


def test_bos_rules(bpe_dir, tmp_path):
    tok = Tokenizer.from_dir(bpe_dir)
    assert tok.add_bos
    assert tok.encode("Hello")[0] == 0
    assert tok.encode("Hello", add_bos=False)[0] != 0
    # Never a second BOS when the text already starts with one.
    ids = tok.encode("<s>Hello")
    assert ids[0] == 0 and ids[1] != 0 and ids == tok.encode("Hello")
    # special=False: special-token text is ordinary text.
    assert 4 in tok.encode("<|im_end|>", add_bos=False)
    assert 4 not in tok.encode("<|im_end|>", add_bos=False, special=False)
    assert tok.decode(tok.encode("<|im_end|>", add_bos=False, special=False)) == "<|im_end|>"

    # tokenizer_config's add_bos_token overrides the post-processor.
    for f in ("tokenizer.json", "generation_config.json"):
        (tmp_path / f).write_bytes((bpe_dir / f).read_bytes())
    cfg = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok2 = Tokenizer.from_dir(tmp_path)
    assert not tok2.add_bos and tok2.encode("Hello")[0] != 0
    assert tok2.encode("Hello", add_bos=True)[0] == 0


def _stream(tok, ids, skip_special=False):
    dec = tok.stream_decoder(skip_special=skip_special)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


def test_stream_decoder_byte_level(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir)
    text = "Un café ☕ à Tōkyō 東京 🤗🚀 👩‍👩‍👧 fin."
    ids = tok.encode(text, add_bos=False)
    # The text really contains tokens that are incomplete characters on their own.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # something was held back until its character completed


def _byte_fallback_dir(tmp_path):
    """A sentencepiece-style tokenizer.json: '▁' spaces, <0xNN> byte tokens, a few words."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁a", "▁fin", "▁caf", "é", "a", "b", "c", "f", "i", "n", "▁b"]:
        vocab[piece] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], unk_token="<unk>",
                                 byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                "add_bos_token": True}))
    return tmp_path


def test_stream_decoder_byte_fallback(tmp_path):
    tok = Tokenizer.from_dir(_byte_fallback_dir(tmp_path))
    text = "a café ☕ 東京 🤗 fin"
    ids = tok.encode(text)
    assert ids[0] == 1
    assert any(tok.id_to_piece(i) == "<0xF0>" for i in ids)  # the emoji is spelled in byte tokens
    pieces = _stream(tok, ids, skip_special=True)
    assert "".join(pieces) == tok.decode(ids, skip_special=True) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "<s> " + text


def test_stream_decoder_long_is_windowed(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir)
    text = " ".join(TEXTS) * 20
    ids = tok.encode(text, add_bos=False)
    dec = tok.stream_decoder()
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == text
    assert len(dec._ids) <= 80  # history is dropped as it is emitted


def _sentencepiece_dir(tmp_path):
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, hard_vocab_limit=False,
                                   character_coverage=1.0, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "added_tokens_decoder": {"400": {"content": "<|im_end|>", "special": True}},
    }))
    return tmp_path, spm.SentencePieceProcessor(model_proto=buf.getvalue())


def test_sentencepiece_fallback(tmp_path):
    d, sp = _sentencepiece_dir(tmp_path)
    tok = Tokenizer.from_dir(d)
    assert tok.bos_id == 1 and tok.eos_ids == {2} and tok.vocab_size == 401
    for text in TEXTS[:6]:
        assert tok.encode(text, add_bos=False) == sp.encode(text)
        assert tok.encode(text) == [1, *sp.encode(text)]  # sentencepiece models add BOS by default
        assert tok.decode(tok.encode(text), skip_special=True) == sp.decode(sp.encode(text))
        assert tok.decode(tok.encode(text)) == "<s>" + sp.decode(sp.encode(text))
    ids = tok.encode("Hello<|im_end|>world", add_bos=False)
    assert ids == [*sp.encode("Hello"), 400, *sp.encode("world")]
    assert tok.decode(ids) == "Hello<|im_end|>world"
    assert tok.decode(ids, skip_special=True) == sp.decode([*sp.encode("Hello"), *sp.encode("world")])
    text = "Café 🤗 日本"
    pieces = _stream(tok, tok.encode(text), skip_special=True)
    assert "".join(pieces) == sp.decode(sp.encode(text))
    assert not any("\ufffd" in p for p in pieces)


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        Tokenizer.from_dir(tmp_path)
