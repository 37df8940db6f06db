"""The GPU tests' greedy decoding through captured decode graphs."""
import torch


def greedy_graph_decode(model, cache, graphs, ids: torch.Tensor, steps: int, table: torch.Tensor):
    """Prefill `ids` [1, T] eagerly into the pages of `table`, then `steps` greedy tokens through `graphs`:
    (logits of the prompt's last position and of each step, float32 on the CPU, [steps + 1, V]; the tokens
    [1, steps])."""
    cache.bind(table)
    with torch.inference_mode():
        logits = [model(ids.cuda(), cache, 0, last_only=True)[:, -1].float().cpu()]
    toks = []
    for i in range(steps):
        tok = logits[-1].argmax(-1)
        toks.append(tok)
        pos = torch.tensor([ids.shape[1] + i], device="cuda")
        logits.append(graphs.step(tok.view(1, 1).cuda(), pos, table).float().cpu())
    return torch.cat(logits), torch.stack(toks, 1)
