"""Text embeddings (generation.embeddings, Engine.embed, /v1/embeddings) against transformers' final hidden states:
a Qwen3 base model saved without a head, as decoder embedding models (Qwen3-Embedding) ship, read at its last
token, and a causal LM mean-pooled. Tolerance: 1e-4 of each vector's largest component (float32 on both sides)."""
import json

import pytest
import torch

from tiny_models import ARCHS, _randomize

from exl2.errors import ConfigError, ContextLengthError, ModelLoadError
from exl2.generation.embeddings import Pooling, embed
from exl2.runtime.loader import load_model

INPUTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 201]]


def _base_model(path, pooling: str | None = "pooling_mode_lasttoken", normalize: bool = True):
    """A tiny Qwen3 saved as AutoModel saves a base model: `embed_tokens.weight`, `layers.…`, no lm_head; with
    sentence-transformers' pooling and module files."""
    from transformers import Qwen3Model

    config = ARCHS["qwen3"]()
    config.tie_word_embeddings = False
    config.architectures = ["Qwen3ForCausalLM"]      # what Qwen3-Embedding's config.json says
    model = Qwen3Model(config)
    _randomize(model, config, 5)
    model.eval().save_pretrained(path, safe_serialization=True)
    if pooling:
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({pooling: True}))
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    return model


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    for a, b in zip(ours, ref):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_embedding")
    return d, _base_model(d)


def test_last_token_pooling_matches_transformers(base):
    d, ref_model = base
    pooling = Pooling.from_dir(d)
    assert pooling == Pooling("last", True)
    model = load_model(d, "cpu")
    assert model.lm_head is None
    with torch.no_grad():
        ref = torch.stack([ref_model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1] for ids in INPUTS])
    _close(embed(model, INPUTS, pooling), torch.nn.functional.normalize(ref, dim=-1))
    _close(embed(model, INPUTS, Pooling("last", False)), ref)
    # Matryoshka: the first components, normalised again
    _close(embed(model, INPUTS, pooling, dimensions=16), torch.nn.functional.normalize(ref[:, :16], dim=-1))
    # one input a batch gives the same vectors as the padded batch
    _close(embed(model, INPUTS, pooling, batch_tokens=1), torch.nn.functional.normalize(ref, dim=-1))


def test_mean_and_cls_pooling_of_a_causal_lm_match_transformers(tmp_path):
    from tiny_models import build_tiny, _load

    d = build_tiny("llama", tmp_path / "llama")
    ref_model = _load(d)
    model = load_model(d, "cpu")
    with torch.no_grad():
        states = [ref_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in INPUTS]
    _close(embed(model, INPUTS, Pooling("mean", False)), torch.stack([s.mean(0) for s in states]))
    _close(embed(model, INPUTS, Pooling("cls", False)), torch.stack([s[0] for s in states]))
    assert Pooling.from_dir(d) == Pooling("last", True)        # no sentence-transformers files: the default


def test_pooling_files_and_overrides(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (d / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Pooling"}]))
    assert Pooling.from_dir(d) == Pooling("mean", False)
    assert Pooling.from_dir(d, "cls") == Pooling("cls", False)


def test_a_model_without_a_head_cannot_generate_and_bad_inputs_are_one_sentence(base):
    d, _ = base
    model = load_model(d, "cpu")
    with pytest.raises(ModelLoadError, match="no output head"):
        model(torch.tensor([[1, 2, 3]]))
    pooling = Pooling.from_dir(d)
    with pytest.raises(ConfigError, match="Input 1 is empty"):
        embed(model, [[1], []], pooling)
    with pytest.raises(ContextLengthError, match="Input 0 is 5 tokens long"):
        embed(model, [[1, 2, 3, 4, 5]], pooling, max_len=4)
    with pytest.raises(ConfigError, match="dimensions must be between 1 and"):
        embed(model, [[1]], pooling, dimensions=0)


def test_engine_and_server_embeddings():
    """Engine.embed on the golden model (texts tokenized as documents) equals the pooled forward, and OpenAI's
    /v1/embeddings serves it: floats, base64 float32, dimensions, usage, and one-sentence 400s."""
    pytest.importorskip("fastapi")
    import asyncio
    import base64
    from pathlib import Path

    import httpx
    import numpy as np

    from exl2.config import EngineConfig, ServerConfig
    from exl2.engine import Engine
    from exl2.server.app import create_app

    model_dir = Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6"
    engine = Engine(EngineConfig(model_dir=model_dir, max_seq_len=512, device="cpu"))
    try:
        texts = ["The quick brown fox", "jumps over the lazy dog.", "Hello"]
        ids = [engine.tokenizer.encode_document(t) for t in texts]
        direct = embed(engine.model, ids, engine.pooling)
        got = engine.embed(texts)
        assert torch.equal(got.vectors, direct) and got.tokens == [len(x) for x in ids]
        app = create_app(engine, ServerConfig(model_name="tiny"))

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                r = await c.post("/v1/embeddings", json={"input": texts, "model": "tiny"})
                assert r.status_code == 200, r.text
                out = r.json()
                assert out["object"] == "list" and out["model"] == "tiny"
                assert out["usage"] == {"prompt_tokens": sum(got.tokens), "total_tokens": sum(got.tokens)}
                assert [d["index"] for d in out["data"]] == [0, 1, 2]
                vecs = torch.tensor([d["embedding"] for d in out["data"]])
                assert torch.allclose(vecs, direct, atol=1e-6)
                r = await c.post("/v1/embeddings", json={"input": ids[0], "encoding_format": "base64",
                                                         "dimensions": 8})
                raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
                want = embed(engine.model, ids[:1], engine.pooling, dimensions=8)[0]
                assert np.allclose(raw, want.numpy(), atol=1e-6) and len(raw) == 8
                for body, param in (({"input": []}, "input"), ({"input": "x", "dimensions": 0}, "dimensions"),
                                    ({"input": [[1, 10 ** 9]]}, "input"), ({"input": "word " * 600}, "input")):
                    r = await c.post("/v1/embeddings", json=body)
                    assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)

        asyncio.run(go())
    finally:
        engine.close()


def test_embed_command(capsys, tmp_path):
    """`exl2 embed`: JSON lines with the engine's vectors, --similarity's cosines, one-sentence errors."""
    from pathlib import Path

    from exl2.cli import main
    from exl2.config import EngineConfig
    from exl2.engine import Engine

    model_dir = str(Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6")
    texts = ["alpha beta", "gamma"]
    lines = tmp_path / "texts.txt"
    lines.write_text("alpha beta\n\ngamma\n")
    assert main.main(["embed", "-m", model_dir, "--device", "cpu", "--file", str(lines), "--dimensions", "8"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    engine = Engine(EngineConfig(model_dir=model_dir, device="cpu"))
    try:
        want = engine.embed(texts, 8)
    finally:
        engine.close()
    assert [r["text"] for r in rows] == texts and [r["tokens"] for r in rows] == want.tokens
    assert torch.allclose(torch.tensor([r["embedding"] for r in rows]), want.vectors, atol=1e-6)
    assert main.main(["embed", "-m", model_dir, "--device", "cpu", "-p", "alpha beta", "-p", "alpha beta",
                      "--similarity"]) == 0
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == ["1.0000", "1.0000"]
    assert main.main(["embed", "-m", model_dir, "--device", "cpu"]) == 2
    assert "Give at least one text" in capsys.readouterr().err


def test_engine_reports_the_inputs_own_index():
    from pathlib import Path

    from exl2.config import EngineConfig
    from exl2.engine import Engine

    engine = Engine(EngineConfig(model_dir=Path(__file__).parent / "fixtures" / "golden" / "b4.0_hb6", device="cpu",
                                 max_seq_len=512))
    try:
        with pytest.raises(ConfigError, match="Input 2 is empty"):
            engine.embed(["long text " * 20, "short", []])
        with pytest.raises(ContextLengthError, match="Input 1 is 600 tokens long"):
            engine.embed([[1, 2], [5] * 600])
        assert engine.embed([]).vectors.shape == (0, engine.model.spec.hidden_size)
    finally:
        engine.close()


def test_a_headless_model_refuses_generation_jobs_one_by_one(base):
    from exl2.generation.dynamic import DynamicGenerator, Job
    from exl2.generation.tokenizer import Tokenizer
    from pathlib import Path

    d, _ = base
    tok = Tokenizer.from_dir(Path(__file__).parent / "fixtures" / "golden" / "src")
    gen = DynamicGenerator(load_model(d, "cpu"), tok, 256, max_batch=2, page_size=16)
    with pytest.raises(ModelLoadError, match="no output head"):
        gen.enqueue(Job([1, 2, 3], max_new_tokens=2))
    assert not gen.has_work()


def test_info_names_an_embedding_model(base, capsys):
    from exl2.cli import main

    d, _ = base
    assert main.main(["info", str(d)]) == 0
    out = " ".join(capsys.readouterr().out.split())     # rich wraps the table to the terminal's width
    assert "embedding model: last-token pooling, normalised" in out
