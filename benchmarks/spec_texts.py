"""Real-text workloads for speculative decoding: the tasks where prompt lookup (n-gram
speculation) is used in practice, because the answer repeats its context.

- ``edit``: correct the spelling of a paragraph (the answer is the paragraph again);
- ``quote``: quote sentences of a passage exactly;
- ``code``: complete a class whose methods repeat its identifiers, and document a given
  function (the answer copies the code);
- ``summary``: summarise an article, quoting its key sentences.

Each prompt is a chat (rendered with the checkpoint's chat template) or plain text to
continue. The texts are written for pdkv; nothing is downloaded.
"""

from __future__ import annotations

LIGHTHOUSE = (
    "The old lighthouse stood at the edge of the cliff for more then two hundred years. "
    "Every night, the keeper climbed the narow stairs to light the lamp, and every morning "
    "he wrote the wether in a small leather book. Ships passing in the dark relied on its "
    "steady beam to avoid the rocks below. When the light was finaly automated, the keeper "
    "moved to the village, but he still walked up the hill each evening to watch the beam "
    "sweep across the water.")

MARKET = (
    "The town market opens every Saturday at seven in the morning. Farmers bring fresh "
    "vegetables, eggs and bread from the villages nearby. A small band plays music near the "
    "fountain while children buy sweets from the corner stall. By noon most of the stalls "
    "have sold out, and the square slowly returns to its quiet weekday pace.")

ARTICLE = (
    "City officials announced on Monday that the river path will close for repairs from "
    "the first of June until the end of August. The path, which is used by thousands of "
    "cyclists and walkers every day, has been damaged by heavy rain over the past two "
    "winters. \"We know the path is important to many people, and we will reopen it as "
    "soon as the work is safe to finish,\" said the city engineer. During the repairs, "
    "cyclists are asked to use the new bridge on Mill Street, which adds about ten minutes "
    "to a typical trip. The repairs will cost two million dollars and will be paid for by "
    "the regional transport fund.")

INVENTORY = '''class InventoryManager:
    """Keeps track of inventory items and a log of every change."""

    def __init__(self):
        self.inventory_items = {}
        self.inventory_log = []

    def add_inventory_item(self, item_name, quantity):
        self.inventory_items[item_name] = self.inventory_items.get(item_name, 0) + quantity
        self.inventory_log.append(("add", item_name, quantity))

    def remove_inventory_item(self, item_name, quantity):
'''

MERGE = '''def merge_sorted_lists(first_list, second_list):
    merged_list = []
    first_index, second_index = 0, 0
    while first_index < len(first_list) and second_index < len(second_list):
        if first_list[first_index] <= second_list[second_index]:
            merged_list.append(first_list[first_index])
            first_index += 1
        else:
            merged_list.append(second_list[second_index])
            second_index += 1
    merged_list.extend(first_list[first_index:])
    merged_list.extend(second_list[second_index:])
    return merged_list
'''


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


WORKLOADS: dict[str, list[list[dict] | str]] = {
    "edit": [
        _user("Fix the spelling mistakes in this paragraph and write the corrected "
              f"paragraph only:\n\n{LIGHTHOUSE}"),
        _user(f"Rewrite this paragraph in the past tense:\n\n{MARKET}"),
    ],
    "quote": [
        _user(f"{LIGHTHOUSE}\n\nQuote the first two sentences of the text above exactly."),
        _user(f"{ARTICLE}\n\nWhat did the city engineer say? Quote the engineer's words."),
    ],
    "code": [
        INVENTORY,
        _user(f"Add a docstring and comments to this Python function:\n\n{MERGE}"),
    ],
    "summary": [
        _user(f"Summarise this article in three sentences, quoting its key facts:\n\n"
              f"{ARTICLE}"),
        _user(f"Summarise this paragraph in two sentences:\n\n{MARKET}"),
    ],
}
"""Workload name -> prompts: chat messages, or a plain text to continue."""


def encode_workloads(tokenizer) -> dict[str, list[list[int]]]:
    """Every workload's prompts as token ids (``common.model.Tokenizer``)."""
    return {name: [tokenizer.encode_chat(p) if isinstance(p, list) else tokenizer.encode(p)
                   for p in prompts]
            for name, prompts in WORKLOADS.items()}
