"""The Python API: Engine from an EngineConfig, sync and async generation, chat through the template."""
import asyncio

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.generation.tokenizer import Tokenizer

from test_cli import SRC


def test_engine_generate_stream_and_async_agree():
    engine = Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu", kv_cache_mode="q8"))
    greedy = SamplingSettings(temperature=0)
    full = engine.generate("The quick brown fox", greedy, max_new_tokens=12)
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    assert "".join(engine.stream("The quick brown fox", greedy, max_new_tokens=12)) == full.text

    async def collect():
        parts = [p async for p in engine.astream("The quick brown fox", greedy, max_new_tokens=12)]
        return parts, await engine.agenerate("The quick brown fox", greedy, max_new_tokens=12)

    parts, again = asyncio.run(collect())
    assert "".join(parts) == full.text and again.token_ids == full.token_ids


def test_engine_stop_strings_and_seeded_sampling():
    engine = Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu"))
    hot = SamplingSettings(temperature=1.0, top_p=0.9, seed=7)
    a = engine.generate("Once", hot, max_new_tokens=10)
    b = engine.generate("Once", hot, max_new_tokens=10)
    assert a.token_ids == b.token_ids
    stop = Tokenizer.from_dir(SRC).decode(a.token_ids[3:5])
    cut = engine.generate("Once", hot, max_new_tokens=10, stop_strings=[stop])
    assert stop not in cut.text and cut.finish_reason == "stop" and a.text.startswith(cut.text)


def test_engine_chat_uses_template():
    engine = Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu"))
    prompt = engine.chat_prompt([{"role": "user", "content": "hi"}])
    assert "hi" in prompt and prompt != "hi"
    assert engine.chat([{"role": "user", "content": "hi"}], SamplingSettings(temperature=0), 4).token_ids


def test_flash_attention_flag_picks_the_prompt_attention_backend(monkeypatch):
    """flash_attention_enabled=False keeps prompt attention in the engine's Triton kernel (no SDPA/flash_attn):
    the backend every fresh-prompt attention call gets, for both settings."""
    from exl2.runtime import paged_cache

    backends = []
    real = paged_cache.varlen_attention

    def spy(*a, backend="auto", **k):
        backends.append(backend)
        return real(*a, backend=backend, **k)

    monkeypatch.setattr(paged_cache, "varlen_attention", spy)
    for flag, want in ((False, "triton"), (True, "auto")):
        backends.clear()
        engine = Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu", flash_attention_enabled=flag))
        assert engine.generate("The quick brown fox", SamplingSettings(temperature=0), max_new_tokens=2).token_ids
        assert backends and set(backends) == {want}


def test_engine_end_controls():
    """stop_token_ids, min_new_tokens and ignore_eos pass through every Engine entry point."""
    engine = Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu"))
    eos = next(iter(engine.tokenizer.eos_ids))
    pushy = SamplingSettings(temperature=0, logit_bias={eos: 100.0})    # EOS would win every step
    plain = engine.generate("The quick brown fox", SamplingSettings(temperature=0), max_new_tokens=6)
    assert engine.generate("The quick brown fox", pushy, max_new_tokens=6).token_ids == []
    assert engine.generate("The quick brown fox", pushy, 6, ignore_eos=True).token_ids == plain.token_ids
    assert "".join(engine.stream("The quick brown fox", pushy, 6, min_new_tokens=3)) == \
        engine.tokenizer.decode(plain.token_ids[:3])
    stop = plain.token_ids[0]
    cut = engine.generate_batch(["The quick brown fox"], SamplingSettings(temperature=0), 6, stop_token_ids=[stop])
    assert (cut[0].token_ids, cut[0].finish_reason) == ([], "stop")
    again = asyncio.run(engine.agenerate("The quick brown fox", pushy, 6, min_new_tokens=2))
    assert (again.token_ids, again.finish_reason) == (plain.token_ids[:2], "stop")
