"""Reasoning budgets (TabbyAPI's reasoning_budget_tokens): after so many tokens inside a think block the generator
feeds the block's end instead of sampling. The reference is an uncached greedy loop on the golden model that
inserts the same tokens at the same place."""
import pytest
import torch

from exl2.config import SamplingSettings
from exl2.generation.budget import CLOSE, OPEN, ReasoningBudget, ThinkTags, budget_end
from exl2.generation.dynamic import DynamicGenerator, Job

import test_dynamic

model, tok = test_dynamic.model, test_dynamic.tok   # the golden model and its tokenizer (module fixtures)
GREEDY = SamplingSettings(temperature=0)


def test_the_budget_counts_inside_the_block():
    inside = ReasoningBudget(3, [7, 8], inside=True)
    assert [inside.step("a", n) for n in (1, 2)] == [None, None]
    assert inside.step("b", 3) == [7, 8] and inside.done and inside.step("c", 4) is None
    opened = ReasoningBudget(2, [9])
    assert opened.step("Let me <th", 1) is None and opened.start is None
    assert opened.step("ink>hmm", 2) is None and opened.start == 2
    assert opened.step(" ok", 3) is None and opened.step(" so", 4) == [9]
    early = ReasoningBudget(5, [9], inside=True)
    assert early.step("done" + CLOSE[:3], 1) is None and early.step(CLOSE[3:] + " answer", 2) is None and early.done
    assert OPEN == "<think>"
    tags = ThinkTags("[THINK]", "[/THINK]")
    other = ReasoningBudget(2, [9], tags=tags)
    assert other.step("<think>x", 1) is None and other.start is None      # not its tags
    assert other.step("[THI", 2) is None and other.step("NK]a", 3) is None and other.start == 3
    assert other.step(" b", 4) is None and other.step(" c", 5) == [9]
    closed = ReasoningBudget(5, [9], inside=True, tags=tags)
    assert closed.step("ok [/THINK] fine", 1) is None and closed.done


def test_budget_end_writes_the_closing_tag(tok):
    assert tok.decode(budget_end(tok, "", ThinkTags("[THINK]", "[/THINK]"))).strip() == "[/THINK]"
    assert tok.decode(budget_end(tok, "Time is up.")).strip() == "Time is up.\n</think>"


def _reference(model, ids, before, forced, after):
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(before):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        seq += forced
        for _ in range(after):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_generator_feeds_the_end_of_the_block(model, tok, overlap):
    ids = tok.encode("Let us think about the weather.")
    end = budget_end(tok, "Time is up.")
    assert tok.decode(end).endswith("\n" + CLOSE + "\n\n")
    want = _reference(model, ids, 4, end, 5)
    gen = DynamicGenerator(model, tok, 256, max_batch=4, page_size=16, overlap=overlap)
    job = Job(ids, GREEDY, 4 + len(end) + 5, budget=ReasoningBudget(4, end, inside=True))
    plain = Job(tok.encode("Paris is"), GREEDY, 12)
    got, other = gen.generate([job, plain])
    assert got.token_ids == want
    assert other.token_ids == _reference(model, plain.ids, 12, [], 0)


def test_forced_tokens_count_as_seen_for_penalties(model, tok):
    """With a repetition penalty the seen-token row must hold the fed end of the block, not the sampled token it
    replaced: the job's row equals one built from its text."""
    ids = tok.encode("Let us think about the weather.")
    end = budget_end(tok)
    gen = DynamicGenerator(model, tok, 256, max_batch=4, page_size=16)
    settings = SamplingSettings(temperature=0, repetition_penalty=1.3)
    job = Job(ids, settings, 3 + len(end) + 2, budget=ReasoningBudget(3, end, inside=True))
    gen.enqueue(job)
    while not job.done:
        gen.iterate()
        if job.slot is not None and not job.done:
            row = gen.seen.mask[job.slot].nonzero().flatten().tolist()
            assert row == sorted(set(job.tokens)), len(job.tokens)
