"""Load a model directory (HF, EXL2, GPTQ) into a DecoderModel on a device."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from exl2.formats.safetensors_io import TensorSource
from exl2.models.decoder import DecoderModel
from exl2.models.registry import read_config, spec_from_config
from exl2.runtime.weights import WeightLoader


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


def pick_device(device: Optional[str] = None) -> torch.device:
    if device:
        if device.startswith("cuda") and not torch.cuda.is_available():
            from exl2.errors import ConfigError
            raise ConfigError("--device cuda was requested but no CUDA GPU is available.")
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(model_dir: Path | str, device: Optional[str] = None, dtype: Optional[torch.dtype] = None
               ) -> DecoderModel:
    cfg = read_config(model_dir)
    spec = spec_from_config(cfg)
    dev = pick_device(device)
    qc = cfg.get("quantization_config") or {}
    loader = WeightLoader(TensorSource(model_dir), dev, dtype or default_dtype(dev),
                          checkpoint_format=qc.get("checkpoint_format", "gptq"), gptq_bits=int(qc.get("bits", 4))
                          if qc.get("quant_method") == "gptq" else 4)
    with torch.no_grad():
        model = DecoderModel(spec, loader)
    model.eval()
    model.config_dict = cfg
    model.model_dir = Path(model_dir)
    return model
