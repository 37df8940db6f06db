"""BERT-family encoders for embeddings (`models.encoder`, `generation.encoder_embeddings`): hidden states against
transformers' BertModel / XLMRobertaModel under padding, pooled vectors against sentence-transformers' recipe
(masked mean or [CLS], L2-normalised), and the server answering /v1/embeddings with an encoder beside a chat model."""
import json

import pytest
import torch

from exl2.generation.encoder_embeddings import EncoderEmbedder
from exl2.models.encoder import is_encoder_dir, load_encoder

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [w for w in (
    "the a an of to in is was it that for on with as his he at by be this had not are but from or have she her "
    "you they we one all were there been has their which said if do will each about how up out them then many "
    "some so these would other into more two time could see no way my than first water long little very after "
    "words called just where most know get through back much go good new write our used me man too any day same "
    "right look think also around another came come work three word must because does part even place well "
    "such here take why things help put years different away again off went old number great tell men say small "
    "every found still between name should home big give air line set own under read last never us left end "
    "along while might next sound below saw something thought both few those always looked show large often "
    "together asked house don world going want school important until form food keep children feet land side "
    "without boy once animals life enough took sometimes four head above kind began almost live page got earth "
    "need far hand high year mother light parts country father let night following picture being study second "
    "eyes soon times story boys since white days ever paper hard near sentence better best across during today "
    "others however sure means knew try told young miles sun ways thing whole hear example heard several change "
    "answer room sea against top turned learn point city play toward five using himself usually").split()]


def _encoder_dir(tmp_path, kind: str = "bert", pooling: str = "mean", normalize: bool = True):
    from transformers import BertConfig, BertModel, BertTokenizerFast, XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    d = tmp_path / kind
    d.mkdir()
    (d / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    BertTokenizerFast(vocab_file=str(d / "vocab.txt")).save_pretrained(d)
    dims = dict(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64)
    if kind == "bert":
        model = BertModel(BertConfig(**dims, max_position_embeddings=64), add_pooling_layer=False)
    else:
        model = XLMRobertaModel(XLMRobertaConfig(**dims, max_position_embeddings=66, pad_token_id=1,
                                                 type_vocab_size=1), add_pooling_layer=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)     # biases and norms matter too
    model.save_pretrained(d)
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_cls_token": pooling == "cls"}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (d / "modules.json").write_text(json.dumps(modules))
    return d, model.eval()


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_hidden_states_match_transformers_under_padding(tmp_path, kind):
    d, ref = _encoder_dir(tmp_path, kind)
    assert is_encoder_dir(d)
    ours = load_encoder(d, "cpu")
    rows = [[2, 40, 41, 42, 43, 44, 3], [2, 50, 3], [2, 60, 61, 62, 3]]
    width = max(len(r) for r in rows)
    pad = 1 if kind != "bert" else 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    got = ours(ids, lengths)
    for i, n in enumerate(lengths.tolist()):       # padding states are not defined
        torch.testing.assert_close(got[i, :n], want[i, :n], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False)])
def test_vectors_follow_sentence_transformers(tmp_path, pooling, normalize):
    d, ref = _encoder_dir(tmp_path, "bert", pooling, normalize)
    emb = EncoderEmbedder.from_dir(d, "cpu")
    texts = ["the old man went home", "a little boy", "children play near the sea every day"]
    result = emb.embed(texts)
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(d)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = ref(**enc).last_hidden_state
    m = enc["attention_mask"][..., None].float()
    want = (states * m).sum(1) / m.sum(1) if pooling == "mean" else states[:, 0]
    if normalize:
        want = torch.nn.functional.normalize(want, dim=-1)
    torch.testing.assert_close(result.vectors, want, atol=2e-5, rtol=1e-4)
    assert result.tokens == enc["attention_mask"].sum(1).tolist()
    assert emb.embed(texts, dimensions=8).vectors.shape == (3, 8)


def test_server_answers_embeddings_with_an_encoder(tmp_path):
    import asyncio

    import openai
    from test_server import FakeEngine, aclient

    from exl2.config import ServerConfig
    from exl2.server.app import create_app

    d, _ = _encoder_dir(tmp_path)
    emb = EncoderEmbedder.from_dir(d, "cpu")
    app = create_app(FakeEngine(), ServerConfig(), embedder=emb)

    async def go():
        c = aclient(app)
        r = await c.embeddings.create(model="bert", input=["the old man", "a boy"])
        assert r.model == "bert" and torch.allclose(torch.tensor([x.embedding for x in r.data]),
                                                    emb.embed(["the old man", "a boy"]).vectors, atol=1e-6)
        assert [m.id for m in (await c.models.list()).data] == ["fake-model", "bert"]
        # no chat model loaded (an admin loads one later): the embedding model still answers
        alone = aclient(create_app(None, ServerConfig(model_dir_root=tmp_path), embedder=emb))
        r = await alone.embeddings.create(model="bert", input="a boy")
        assert len(r.data) == 1 and r.model == "bert"
        with pytest.raises(openai.APIStatusError) as e:
            await aclient(create_app(None, ServerConfig(model_dir_root=tmp_path))).embeddings.create(
                model="x", input="a boy")
        assert e.value.status_code == 503
    asyncio.run(go())


def test_serve_loads_an_encoder_as_the_embedding_model(tmp_path):
    """--embedding-model on an encoder directory loads the encoder (not a decoder Engine); a bad directory is a
    one-sentence error."""
    from exl2.cli import serve
    from exl2.cli.main import build_parser
    from exl2.errors import Exl2Error

    d, _ = _encoder_dir(tmp_path)
    args = build_parser().parse_args(["serve", "--embedding-model", str(d), "--device", "cpu"])
    assert isinstance(serve._load_embedder(args), EncoderEmbedder)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    args = build_parser().parse_args(["serve", "--embedding-model", str(tmp_path / "empty"), "--device", "cpu"])
    with pytest.raises(Exl2Error) as e:
        serve._load_embedder(args)
    assert "\n" not in str(e.value) and str(e.value).endswith(".")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_on_the_gpu_is_near_the_cpu(tmp_path):
    d, _ = _encoder_dir(tmp_path)
    texts = ["the old man went home", "a little boy"]
    cpu = EncoderEmbedder.from_dir(d, "cpu").embed(texts).vectors
    gpu = EncoderEmbedder.from_dir(d, "cuda").embed(texts).vectors
    assert (gpu - cpu).abs().max() < 1e-2
