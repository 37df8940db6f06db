"""The fabricated bench model's option-table body (`exl2 bench --mixed table`): exllamav2's options as a 4.0 bpw
conversion leaves them, loadable as any EXL2 checkpoint."""
import pytest
import torch

from exl2.formats.exl2 import group_layout, layer_storage_bits
from exl2.runtime.synthetic import (LLAMA3_8B, DictSource, llama_exl2_tensors, projection_shapes, synthetic_model,
                                    table_options)

ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_table_options_average_the_target_and_vary_the_widths():
    """Every layer gets every projection an option; the stored bits a weight average 4.0 within 0.1; the width
    mixes differ between projections and between layers, as in real files."""
    shapes = projection_shapes(LLAMA3_8B)
    assert shapes["k_proj"] == (4096, 1024) and shapes["down_proj"] == (14336, 4096)
    opts = table_options(LLAMA3_8B)
    assert len(opts) == LLAMA3_8B["num_hidden_layers"] and all(set(o) == set(ROLES) for o in opts)
    bits = sum(layer_storage_bits(*shapes[r], group_layout(shapes[r][0], *o[r]), 0) for o in opts for r in ROLES)
    weights = len(opts) * sum(k * n for k, n in shapes.values())
    assert abs(bits / weights - 4.0) < 0.1
    assert len({tuple(o["q_proj"][0]) for o in opts}) >= 3
    assert len({tuple(o["down_proj"][0]) for o in opts}) >= 2
    assert any(o["v_proj"][0] != o["q_proj"][0] for o in opts)
    assert table_options(LLAMA3_8B, spread=0.0)[0] == table_options(LLAMA3_8B, spread=0.0)[-1]


def test_table_body_loads_with_its_options():
    """A small model with the option-table body loads through the EXL2 reader with each matrix's widths as its
    option says, and runs a forward pass."""
    from exl2.models.decoder import DecoderModel
    from exl2.models.registry import spec_from_config
    from exl2.runtime.weights import WeightLoader

    cfg = dict(LLAMA3_8B, num_hidden_layers=3, hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=300)
    opts = table_options(cfg)
    tensors = DictSource(llama_exl2_tensors(cfg, body=opts))
    model = DecoderModel(spec_from_config(cfg), WeightLoader(tensors, "cpu", torch.float16, use_kernels=True)).eval()
    for layer, o in zip(model.layers, opts):
        for r in ROLES:
            lin = getattr(layer.self_attn if r in ROLES[:4] else layer.mlp, r)
            assert [c.bits for c in lin.kernel.classes] == o[r][0]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 300) and torch.isfinite(logits).all()


def test_unknown_body_is_refused():
    with pytest.raises(ValueError, match="body must be one of"):
        synthetic_model(torch.device("cpu"), 1, "5bit")
