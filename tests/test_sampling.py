"""T > 0: exact target-sample matching is lossless, and a seed fixes the output."""

import pytest
import torch

from conftest import make_drafter, make_markov
from dartree.decode.generate import speculative_generate
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import Tree
from dartree.decode.verify import verify
from dartree.models.target import compact_cache, tiny_target

CHI2_DF3_P1E3 = 16.266  # chi-square critical value, 3 degrees of freedom, p = 1e-3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("children", [[2], [3, 0, 3]])  # chain; siblings with a duplicate token
def test_first_committed_token_is_distributed_as_target_sample(children):
    tg = tiny_target(vocab_size=4, hidden_size=16, num_layers=2, seed=3)
    with torch.no_grad():
        tg.model.lm_head.weight.mul_(0.3)  # a spread-out distribution over the 4 tokens
    prefix, root, temp, n = [1, 2, 3, 0, 2], 1, 0.8, 1500
    cache = tg.new_cache()
    tg.forward(torch.tensor([prefix]), cache=cache)
    z = tg.forward(torch.tensor([prefix + [root]])).logits[0, -1]
    probs = torch.softmax(z / temp, -1)
    assert probs.min() > 0.03
    m = len(children)
    tree = Tree(torch.tensor(children), torch.zeros(m, dtype=torch.long), torch.ones(m, dtype=torch.long), torch.zeros(m))
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(n):
        v = verify(tg, tree, root, len(prefix), cache, temperature=temp, generator=gen)
        first = v.tokens[0] if v.tokens else v.bonus_id
        counts[first] += 1
        compact_cache(cache, len(prefix), torch.zeros(0, dtype=torch.long))  # back to the prefix
    assert _chi2(counts, probs) < CHI2_DF3_P1E3, (counts / n, probs)


def test_sampling_same_seed_same_output(target, prompts):
    drafter, head = make_drafter(), make_markov()
    for p in prompts[:3]:
        runs = [
            speculative_generate(target, drafter, head, p, DecodeSettings(builder="pruned", budget=8, max_new_tokens=30,
                                                                          temperature=1.0),
                                 generator=torch.Generator().manual_seed(5)).tokens
            for _ in range(2)
        ]
        assert runs[0] == runs[1] and len(runs[0]) > 0
