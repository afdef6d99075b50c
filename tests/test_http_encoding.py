"""The front door encodes long texts on a thread, never on its loop: while one request's
text is being encoded, others are checked and answered; encoding counts as waiting for
admission (429 past ``max_waiting``); a shutdown ends it with a 503; a text that cannot
fit a row is refused before anything encodes it. In process: the encoding thread is held
on a gate (a ``TextModel`` subclass) so that the order of events, not a clock, shows it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.config import ServeConfig
from common.control import CODEC, StatusReport
from deploy.http.app import LOOP_TEXT_CHARS, FrontDoor
from deploy.http.bridge import RouterBridge
from deploy.http.errors import ApiError
from deploy.http.schemas import ChatCompletionRequest, CompletionRequest
from deploy.http.text import TextModel, load_text_model

WORKERS = {"p0": {"role": "prefill", "ready": True, "lost": False, "pid": 1, "paused": ""},
           "d0": {"role": "decode", "ready": True, "lost": False, "pid": 2, "paused": ""}}
LONG = "the quick brown fox. " * (LOOP_TEXT_CHARS // 21 + 20)  # ~2k tokens: fits a row


class GatedText(TextModel):
    """The served tokenizer, except that a long text waits at a gate before encoding."""

    def __init__(self, real: TextModel) -> None:
        super().__init__(real._tok, real._stop_strings)
        self.entered, self.gate = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        if len(text) > LOOP_TEXT_CHARS:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return super().encode(text)


@pytest.fixture
def door():
    bridge = RouterBridge("ipc:///nonexistent/pdkv-router.sock")   # nothing is sent
    config = ServeConfig().to_dict()
    bridge._dispatch(CODEC.decode(CODEC.encode(StatusReport(WORKERS, 0, config))))
    front = FrontDoor(bridge, max_waiting=2)
    view = front.view()
    real = load_text_model(view.config)
    assert real is not None, "the built-in model has a tokenizer"
    yield front, front.limits(view), GatedText(real)
    front.shutdown("test over")
    bridge._port.close()


async def _until(event: threading.Event) -> None:
    for _ in range(3000):                # the loop stays free while the thread works
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the encoding thread never started")


def test_a_long_text_encodes_on_a_thread_while_short_requests_are_planned(door):
    front, lim, text = door

    async def story():
        long = asyncio.create_task(front.plan(CompletionRequest(prompt=LONG, max_tokens=4),
                                              False, lim, text))
        await _until(text.entered)
        assert front.encoding == 1
        order = []
        for prompt in ("hello there", [5, 6, 7]):  # a short text and token ids
            plan = await front.plan(CompletionRequest(prompt=prompt, max_tokens=4), False,
                                    lim, text)
            order.append((prompt, long.done(), len(plan.prompt)))
        chat = await front.plan(ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], max_tokens=4), True, lim, text)
        order.append(("chat", long.done(), len(chat.prompt) > 0))
        text.gate.set()
        plan = await long
        return order, plan

    order, plan = asyncio.run(story())
    assert [done for _, done, _ in order] == [False, False, False], order
    assert order[1][2] == 3 and order[2][2] is True
    assert text.threads and all(t.startswith("pdkv-encode") for t in text.threads)
    assert plan.prompt == text.encode(LONG) and len(plan.prompt) > 1000
    assert front.encoding == 0


def test_encoding_counts_as_waiting_and_a_full_door_refuses_with_429(door):
    front, lim, text = door

    async def story():
        first = asyncio.create_task(front.plan(CompletionRequest(prompt=LONG, max_tokens=4),
                                               False, lim, text))
        await _until(text.entered)
        second = asyncio.create_task(front.plan(CompletionRequest(prompt=LONG + "x",
                                                                  max_tokens=4),
                                                False, lim, text))
        while front.encoding < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as refused:                 # max_waiting=2
            await front.plan(CompletionRequest(prompt=LONG + "y", max_tokens=4), False, lim,
                             text)
        text.gate.set()
        return refused.value, await first, await second

    refused, first, second = asyncio.run(story())
    assert refused.status == 429 and "encoding" in refused.message
    assert first.prompt and second.prompt


def test_shutdown_while_encoding_answers_503(door):
    front, lim, text = door

    async def story():
        task = asyncio.create_task(front.plan(CompletionRequest(prompt=LONG, max_tokens=4),
                                              False, lim, text))
        await _until(text.entered)
        queued = asyncio.create_task(front.plan(CompletionRequest(prompt=LONG + "x",
                                                                  max_tokens=4),
                                                False, lim, text))
        while front.encoding < 2:
            await asyncio.sleep(0.01)
        front.shutdown("stopping")
        text.gate.set()
        return await asyncio.gather(task, queued, return_exceptions=True)

    results = asyncio.run(story())
    for r in results:
        assert isinstance(r, ApiError) and r.status == 503 and "shutting down" in r.message
    assert front.encoding == 0


def test_a_text_that_cannot_fit_a_row_is_refused_before_it_is_encoded(door):
    front, lim, text = door
    huge = "a" * (lim.max_row * text.max_token_chars + 1)

    async def story():
        errors = []
        for body, chat in ((CompletionRequest(prompt=huge, max_tokens=4), False),
                           (ChatCompletionRequest(messages=[{"role": "user",
                                                             "content": huge}],
                                                  max_tokens=4), True)):
            with pytest.raises(ApiError) as refused:
                await front.plan(body, chat, lim, text)
            errors.append(refused.value)
        return errors

    text.gate.set()
    errors = asyncio.run(story())
    assert [e.status for e in errors] == [413, 413]
    assert "cannot fit" in errors[0].message and errors[0].param == "prompt"
    assert errors[1].param == "messages"
    assert not text.threads            # refused before any encoding began
