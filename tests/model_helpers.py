"""The tiny model at float64 (where batching cannot flip a greedy token), seeded prompts,
and a runner that watches when the first tokens leave."""

from __future__ import annotations

import torch

from common.control import ControlLink
from common.model import ModelRunner, get_config

F64 = get_config("tiny", dtype="float64")


def prompt(n: int, seed: int = 1) -> list[int]:
    """``n`` token ids drawn from ``seed``: the same prompt in every test and process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, F64.vocab_size, (n,), generator=gen).tolist()


class DraftWatchingRunner(ModelRunner):
    """``runner``'s model, pool and draft; notes, as each draft pass starts, the rids
    whose first token went out on ``link`` (a ``FakeLink``) by then."""

    def __init__(self, runner: ModelRunner, link: ControlLink) -> None:
        super().__init__(runner.model, runner.cache, runner.draft)
        self.link, self.heard_at_draft = link, []

    def run(self, pp, dev, source=None):
        if pp.draft:
            self.heard_at_draft.append([m.rid for m in self.link.tokens() if m.first])
        return super().run(pp, dev, source)
