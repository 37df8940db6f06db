"""The `exl2` command as a user meets it: output of generate/info, and one-sentence errors with exit code 2."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).parent / "fixtures" / "golden" / "src"


def exl2(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "exl2.cli.main", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def assert_user_error(r, *words):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_generate_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The quick brown fox"
    r = exl2("generate", "-m", str(SRC), "-p", prompt, "--max-new-tokens", "20", "--temperature", "0",
             "--device", "cpu")
    assert r.returncode == 0, r.stderr
    tok = AutoTokenizer.from_pretrained(SRC)
    model = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float32).eval()
    from exl2.generation.tokenizer import Tokenizer

    # Same prompt ids for both (the model's tokenizer_config asks for a BOS, which exl2 adds).
    ids = torch.tensor([Tokenizer.from_dir(SRC).encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
    expected = tok.decode(out[0, ids.shape[1]:])
    assert r.stdout.rstrip("\n") == expected


def test_info_dense():
    r = exl2("info", str(SRC))
    assert r.returncode == 0, r.stderr
    assert "LlamaForCausalLM" in r.stdout and "fp16" in r.stdout and "2048" in r.stdout


def test_missing_directory(tmp_path):
    assert_user_error(exl2("generate", "-m", str(tmp_path / "nope"), "-p", "x"), "does not exist")


def test_directory_without_config(tmp_path):
    assert_user_error(exl2("info", str(tmp_path)), "config.json")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    assert_user_error(exl2("info", str(tmp_path)), "FalconForCausalLM", "LlamaForCausalLM", "Gemma2ForCausalLM")


def test_truncated_safetensors(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(SRC, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_user_error(exl2("generate", "-m", str(d), "-p", "hi", "--device", "cpu"), "truncated")


def test_prompt_longer_than_context():
    r = exl2("generate", "-m", str(SRC), "-p", "word " * 3000, "--device", "cpu", "-l", "1024")
    assert_user_error(r, "context")


def test_invalid_sampling_value():
    assert_user_error(exl2("generate", "-m", str(SRC), "-p", "x", "--top-p", "0"), "top_p")


def test_help_documents_flags():
    r = exl2("generate", "--help")
    assert r.returncode == 0
    for flag in ("--prompt", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--device"):
        assert flag in r.stdout


def test_chat_piped(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(SRC, d)
    r = exl2("chat", "-m", str(d), "--temperature", "0", "-maxr", "8", "--device", "cpu", stdin="hello\n/clear\nagain\n")
    assert r.returncode == 0, r.stderr
    replies = [b for b in r.stdout.split("\n\n") if b.strip()]
    assert len(replies) == 2


def chat_in_process(monkeypatch, capsys, stdin: str, *flags: str) -> tuple[int, list[str], list[int], str, str]:
    """Run `exl2 chat` on the golden model in this process, piping `stdin`: (exit code, every prompt the generator
    received as text, their token counts, stdout, stderr)."""
    import io

    from exl2.cli import chat, main

    seen: list[list[int]] = []
    tok_box = []
    real = chat.load_generator

    def spying_loader(args):
        model_dir, tok, gen = real(args)
        tok_box.append(tok)
        stream = gen.stream

        def recording_stream(prompt, *a, **k):
            seen.append(list(prompt))
            return stream(prompt, *a, **k)

        gen.stream = recording_stream
        return model_dir, tok, gen

    monkeypatch.setattr(chat, "load_generator", spying_loader)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main.main(["chat", "-m", str(SRC), "--device", "cpu", "--temperature", "0", *flags])
    out, err = capsys.readouterr()
    return rc, [tok_box[0].decode(ids) for ids in seen], [len(ids) for ids in seen], out, err


def test_chat_drops_oldest_turns_when_the_context_fills(monkeypatch, capsys):
    turns = [f"question {i}: " + " ".join(["tell me about the weather"] * 12) for i in range(8)]
    rc, prompts, lengths, out, err = chat_in_process(monkeypatch, capsys, "\n".join(turns) + "\n",
                                                     "-l", "512", "-maxr", "64", "-sp", "You are terse.")
    assert rc == 0 and "Traceback" not in err and "error" not in err, err
    assert len(prompts) == len(turns) and out.strip()  # every turn reached the model
    assert all(n + 64 <= 512 for n in lengths), lengths  # each prompt left the reply its budget
    assert "(context full: dropped the" in err
    for i, prompt in enumerate(prompts):
        assert prompt.count("You are terse.") == 1 and prompt.index("You are terse.") < prompt.index("question")
        assert turns[i] in prompt
    assert "question 0:" not in prompts[-1] and "question 6:" in prompts[-1]  # oldest gone, the newest kept


def test_chat_oversized_message_is_one_error_and_the_session_goes_on(monkeypatch, capsys):
    stdin = "hello there\n" + "word " * 600 + "\nand again\n"
    rc, prompts, _, out, err = chat_in_process(monkeypatch, capsys, stdin, "-l", "512", "-maxr", "16")
    assert rc == 0 and "Traceback" not in err
    errors = [l for l in err.splitlines() if l.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: This message") and "512" in errors[0], err
    assert len(prompts) == 2 and out.strip()
    assert "hello there" in prompts[1] and "and again" in prompts[1] and "word word" not in prompts[1]


@pytest.mark.parametrize("amnesia", [False, True])
def test_chat_amnesia_forgets_earlier_turns(monkeypatch, capsys, amnesia):
    flags = ["-maxr", "8", "-sp", "Be brief."] + (["-amnesia"] if amnesia else [])
    rc, prompts, _, _, err = chat_in_process(monkeypatch, capsys, "first message\nsecond message\n", *flags)
    assert rc == 0, err
    assert "Be brief." in prompts[1] and "second message" in prompts[1]
    assert ("first message" in prompts[1]) is not amnesia


def test_chat_no_system_prompt_sends_an_empty_one(monkeypatch, capsys):
    rc, prompts, _, _, err = chat_in_process(monkeypatch, capsys, "hi\n", "-maxr", "4", "-nsp")
    assert rc == 0, err
    assert prompts[0].startswith("<|im_start|>system\n<|im_end|>")  # the golden model falls back to ChatML


def test_quantized_cache_needs_head_dim_64():
    # the golden model has head_dim 64: q4 works; a model with head_dim 16 gets one clear sentence
    assert exl2("generate", "-m", str(SRC), "-p", "x", "-n", "2", "-cm", "q4", "--device", "cpu").returncode == 0


def test_quantized_cache_rejects_small_heads(tmp_path):
    from tiny_models import build_tiny
    d = build_tiny("llama", tmp_path / "m")
    shutil.copy(SRC / "tokenizer.json", d)
    shutil.copy(SRC / "tokenizer_config.json", d)
    assert_user_error(exl2("generate", "-m", str(d), "-p", "x", "-cm", "q4", "--device", "cpu"), "divisible by 64")


@pytest.mark.parametrize("args,word", [(["--modes", "q5"], "--modes"), (["--contexts", "12x"], "--contexts"),
                                       (["--batch", "0"], "--batch"), (["--breakdown-batch", "3"], "--breakdown-batch"),
                                       (["--breakdown-mode", "q5"], "--breakdown-mode")])
def test_bench_rejects_bad_options_in_one_sentence(args, word):
    """Checked before anything touches the GPU, so the same on machines with and without one."""
    assert_user_error(exl2("bench", *args), word)


# ---------------------------------------------------------------- RoPE overrides: -rs/-ra/-ry reach the model

@pytest.mark.parametrize("command", [["generate", "-p", "x"], ["chat"], ["serve"], ["mcp", "serve"],
                                     ["mcp", "agent", "--server", "x", "-p", "y"]])
def test_rope_flags_reach_engine_config(command):
    from exl2.cli.common import engine_settings, rope_from_args
    from exl2.cli.main import build_parser
    from exl2.config import EngineConfig

    parser = build_parser()
    args = parser.parse_args([*command, "-m", str(SRC), "-rs", "2", "--rope-alpha", "1.5"])
    config = EngineConfig(**engine_settings(args))
    assert (config.rope_scale, config.rope_alpha, config.rope_yarn) == (2.0, 1.5, None)
    assert "max_seq_len" not in config.model_fields_set   # no -l: the default, not a request to honour
    args = parser.parse_args([*command, "-m", str(SRC), "--rope_yarn", "3", "-l", "8192"])
    config = EngineConfig(**engine_settings(args))
    assert config.rope_yarn == 3.0 and config.max_seq_len == 8192
    assert rope_from_args(args).yarn == 3.0 and rope_from_args(args).context == 8192


def test_graph_and_chunk_flags_reach_the_generator(monkeypatch):
    """-ng and --chunk-size reach EngineConfig and the engine's DynamicGenerator (and the CLI's own generator)."""
    from exl2 import engine as engine_mod
    from exl2.cli.common import engine_settings, load_generator
    from exl2.cli.main import build_parser
    from exl2.config import EngineConfig
    from exl2.generation import generator as generator_mod

    seen = []

    class Recording(engine_mod.DynamicGenerator):
        def __init__(self, *a, **kw):
            seen.append((kw.get("use_graphs", True), kw.get("chunk")))
            super().__init__(*a, **kw)

    monkeypatch.setattr(engine_mod, "DynamicGenerator", Recording)
    monkeypatch.setattr(generator_mod, "DynamicGenerator", Recording)
    parser = build_parser()
    args = parser.parse_args(["serve", "-m", str(SRC), "-ng", "--chunk-size", "512", "-l", "512"])
    config = EngineConfig(**{**engine_settings(args), "device": "cpu"})
    assert (config.cuda_graphs, config.chunk_size) == (False, 512)
    engine_mod.Engine(config).close()
    assert seen[-1] == (False, 512)
    default = EngineConfig(**{**engine_settings(parser.parse_args(["serve", "-m", str(SRC)])), "device": "cpu"})
    assert (default.cuda_graphs, default.chunk_size) == (True, 2048)
    _, _, gen = load_generator(parser.parse_args(["generate", "-m", str(SRC), "-p", "x", "-ng", "--chunk-size",
                                                  "256", "--device", "cpu", "-l", "512"]))
    list(gen.stream("x", max_new_tokens=1))
    assert seen[-1] == (False, 256)


@pytest.mark.parametrize("command", [["eval"], ["bench"]])
def test_rope_flags_on_eval_and_bench(command):
    from exl2.cli.common import rope_from_args
    from exl2.cli.main import build_parser

    rope = rope_from_args(build_parser().parse_args([*command, "-m", str(SRC), "-ry", "2"]))
    assert rope.yarn == 2.0 and rope.scale is None and rope.alpha is None


def test_rope_yarn_with_scale_is_one_sentence():
    assert_user_error(exl2("generate", "-m", str(SRC), "-p", "x", "-ry", "2", "-rs", "2", "--device", "cpu"),
                      "rope_yarn cannot be combined")
    assert_user_error(exl2("generate", "-m", str(SRC), "-p", "x", "-rs", "0", "--device", "cpu"),
                      "rope_scale must be a positive number")


def test_context_past_the_model_warns_once_unless_rope_extends_it():
    r = exl2("generate", "-m", str(SRC), "-p", "The quick brown fox", "-n", "4", "-l", "4096", "--device", "cpu",
             "--temperature", "0")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "capped at 2048" in lines[0], r.stderr
    r = exl2("generate", "-m", str(SRC), "-p", "The quick brown fox", "-n", "4", "-l", "4096", "-rs", "2",
             "--device", "cpu", "--temperature", "0")
    assert r.returncode == 0 and "capped" not in r.stderr, r.stderr


# ---------------------------------------------------------------- exllamav2's further sampler flags

@pytest.mark.parametrize("command", [["generate", "-p", "x"], ["chat"], ["mcp", "agent", "--server", "x", "-p", "y"]])
def test_sampler_flags_reach_sampling_settings(command):
    from exl2.cli.common import sampling_from_args
    from exl2.cli.main import build_parser
    from exl2.config import SamplingSettings

    parser = build_parser()
    short = sampling_from_args(parser.parse_args([
        *command, "-smooth", "0.3", "-dyntemp", "0.5,1.5,1", "-topa", "0.2", "-typical", "0.8", "-tfs", "0.9",
        "-xtcp", "0.4", "-xtct", "0.2", "-drym", "0.8", "-drya", "3", "-dryb", "2", "-dryr", "64", "-mirostat", "2"]))
    assert (short.smoothing_factor, short.min_temp, short.max_temp, short.temp_exponent) == (0.3, 0.5, 1.5, 1.0)
    assert (short.top_a, short.typical, short.tfs, short.xtc_probability, short.xtc_threshold) == (
        0.2, 0.8, 0.9, 0.4, 0.2)
    assert (short.dry_multiplier, short.dry_allowed_length, short.dry_base, short.dry_range) == (0.8, 3, 2.0, 64)
    assert short.mirostat_mode == 2 and short.dynamic_temperature
    long = sampling_from_args(parser.parse_args([
        *command, "--smoothing-factor", "0.1", "--dynamic-temperature", "0.2,2,0.5", "--temperature-last",
        "--top-a", "0.1", "--typical", "0.7", "--tfs", "0.95", "--xtc-probability", "0.5", "--xtc-threshold", "0.3",
        "--dry-multiplier", "1", "--dry-allowed-length", "4", "--dry-base", "1.5", "--dry-range", "128",
        "--dry-max-ngram", "8", "--dry-sequence-breakers", r"\n,:,end", "--mirostat", "2", "--mirostat-tau", "3", "--mirostat-eta", "0.2"]))
    assert (long.min_temp, long.max_temp, long.temp_exponent, long.temperature_last) == (0.2, 2.0, 0.5, True)
    assert long.dry_sequence_breakers == ("\n", ":", "end") and (long.mirostat_tau, long.mirostat_eta) == (3.0, 0.2)
    assert (long.dry_multiplier, long.dry_allowed_length, long.dry_base, long.dry_range) == (1.0, 4, 1.5, 128)
    assert long.dry_max_ngram == 8 and short.dry_max_ngram == 20
    ranged = sampling_from_args(parser.parse_args([*command, "-repp", "1.2", "--repetition-range", "512",
                                                   "--repetition-decay", "128"]))
    assert (ranged.repetition_range, ranged.repetition_decay) == (512, 128) and ranged.ranged_penalty
    banned = sampling_from_args(parser.parse_args([*command, "--banned-string", "a, b", "--banned-string", "c"]))
    assert banned.banned_strings == ("a, b", "c") and not banned.token_healing
    assert sampling_from_args(parser.parse_args([*command, "--token-healing"])).token_healing
    default, engine = sampling_from_args(parser.parse_args(command)), SamplingSettings()
    assert default.model_dump(exclude={"temperature"}) == engine.model_dump(exclude={"temperature"})


@pytest.mark.parametrize("flags,words", [(["-dyntemp", "0.5"], ("--dynamic-temperature", "'0.5'")),
                                         (["-dyntemp", "a,b,c"], ("--dynamic-temperature", "three numbers")),
                                         (["-dyntemp", "0.5,11,1"], ("--dynamic-temperature", "max_temp")),
                                         (["-xtcp", "2"], ("xtc_probability",)),
                                         (["-dryb", "0.5"], ("dry_base",))])
def test_bad_sampler_flags_are_one_sentence(flags, words):
    """Checked before the model loads (a missing model would be the error otherwise)."""
    assert_user_error(exl2("generate", "-m", "/nonexistent-model", "-p", "x", *flags), *words)
