"""`exl2 serve --config`: TabbyAPI's config.yml read into serve's flags (command-line flags win), and its errors as
one sentence with a non-zero exit."""
from __future__ import annotations

import logging

import pytest

from exl2.cli import serve
from exl2.cli.main import build_parser, main
from exl2.cli.serve_config import apply_config_file
from exl2.errors import ConfigError

TABBY = """\
network:
  host: 0.0.0.0
  port: 5001
  sse_ping_interval: 5
  disable_auth: false
  api_servers: ["OAI"]
logging:
  log_prompt: true
model:
  model_dir: {root}
  model_name: Llama-3-8B-exl2
  max_seq_len: 8192
  cache_size: 16384
  cache_mode: Q4
  gpu_split_auto: true
  rope_scale: 1.0
  rope_alpha: auto
  chunk_size: 1024
  max_batch_size: 8
  prompt_template: chatml
  inline_model_loading: true
  vision: true
draft_model:
  draft_model_dir: {root}
  draft_model_name: tiny-draft
  draft_rope_alpha: 2.5
  draft_num_tokens: 3
lora:
  lora_dir: {root}/loras
  loras:
    - name: style
      scaling: 0.5
sampling:
  override_preset: safe_defaults
embeddings:
  embedding_model_dir: {root}/emb
  embedding_model_name: Qwen3-Embedding-0.6B
  embeddings_device: cpu
"""


def _args(argv: list[str]):
    return build_parser().parse_args(["serve", *argv])


def _write(tmp_path, text: str):
    path = tmp_path / "config.yml"
    path.write_text(text, encoding="utf-8")
    return path


def test_tabbyapi_config_fills_the_flags(tmp_path, caplog):
    path = _write(tmp_path, TABBY.format(root=tmp_path))
    with caplog.at_level(logging.WARNING, logger="exl2.server"):
        args = apply_config_file(_args(["--config", str(path)]), serve._PARSER)
    assert (args.host, args.port, args.sse_ping_interval) == ("0.0.0.0", 5001, 5.0)
    assert args.model_dir_root == str(tmp_path) and args.model_dir == str(tmp_path / "Llama-3-8B-exl2")
    assert (args.max_seq_len, args.cache_size, args.cache_mode, args.gpu_split) == (8192, 16384, "q4", "auto")
    assert (args.rope_scale, args.rope_alpha, args.chunk_size, args.max_batch_size) == (1.0, None, 1024, 8)
    assert args.prompt_template == "chatml" and args.inline_model_loading is True and args.vision is True
    assert args.draft_model_dir == str(tmp_path / "tiny-draft") and args.draft_rope_alpha == 2.5
    assert args.num_draft_tokens == 3 and args.sampler_override == "safe_defaults"
    assert args.lora_dir == f"{tmp_path}/loras" and args.loras == [str(tmp_path / "loras" / "style")]
    assert args.lora_scaling == [0.5]
    assert args.embedding_model == str(tmp_path / "emb" / "Qwen3-Embedding-0.6B")
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "network.api_servers" in warned and "embeddings.embeddings_device" in warned
    assert "model.max_seq_len" not in warned and "embeddings.embedding_model_name" not in warned
    assert args.log_prompt is True and "logging.log_prompt" not in warned


def test_command_line_flags_win_over_the_file(tmp_path):
    path = _write(tmp_path, TABBY.format(root=tmp_path))
    args = apply_config_file(_args(["--config", str(path), "--port", "6000", "-m", "/models/other", "-cm", "q8",
                                    "--gpu_split", "20,24"]), serve._PARSER)
    assert (args.port, args.model_dir, args.cache_mode, args.gpu_split) == (6000, "/models/other", "q8", "20,24")
    assert args.max_seq_len == 8192          # not given on the command line: the file's


def test_explicit_gpu_split_and_an_empty_file(tmp_path):
    path = _write(tmp_path, "model:\n  gpu_split: [20, 24.5]\n  gpu_split_auto: true\n")
    assert apply_config_file(_args(["--config", str(path)]), serve._PARSER).gpu_split == "20.0,24.5"
    empty = _write(tmp_path, "")
    assert apply_config_file(_args(["--config", str(empty)]), serve._PARSER).port == 5000


@pytest.mark.parametrize("text,words", [
    (None, "does not exist"),
    ("model: [unclosed\n", "not valid YAML at line"),
    ("- just\n- a list\n", "must hold sections"),
    ("model:\n  max_seq_len: lots\n", "model.max_seq_len must be a whole number"),
    ("model:\n  cache_mode: Q5\n", "model.cache_mode must be one of FP16"),
    ("model:\n  gpu_split: 20\n", "model.gpu_split must be a list of GB per GPU"),
    ("model:\n  rope_alpha: high\n", "model.rope_alpha must be a number or auto"),
    ("lora:\n  loras: [style]\n", "list of {name, scaling} entries"),
])
def test_bad_config_files_are_one_sentence(tmp_path, capsys, text, words):
    path = tmp_path / "config.yml" if text is None else _write(tmp_path, text)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("{", r"\{")):
        apply_config_file(_args(["--config", str(path)]), serve._PARSER)
    rc = main(["serve", "--config", str(path), "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]
