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


def three_prompts(model, cache, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill three random prompts of 10, 70 and 33 tokens into four pages each (pages 0-11) and draw one
    next token each: (block table [3, 4], positions [3], ids [3, 1]) of the batch-3 step that follows."""
    table = torch.arange(12, dtype=torch.int32, device="cuda").view(3, 4)
    lens = [10, 70, 33]
    for b, n in enumerate(lens):
        cache.bind(table[b:b + 1])
        with torch.inference_mode():
            model(torch.randint(0, vocab, (1, n), device="cuda"), cache, 0)
    return table, torch.tensor(lens, device="cuda"), torch.randint(0, vocab, (3, 1), device="cuda")
