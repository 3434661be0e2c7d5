"""The chat UI driven by Textual's Pilot against tests/fake_engine.FakeModel (plus one run on the
real default model). Tests are synchronous functions that run the async Pilot session with asyncio.run,
so no pytest plugin is needed."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import pytest
from textual.widgets import Input, Sparkline, Static

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import DEFAULT_REPLY, FakeModel, count_tokens  # noqa: E402

from edgellm.tui.app import ChatApp  # noqa: E402
from edgellm.tui.screens.chat import ChatScreen  # noqa: E402
from edgellm.tui.screens.settings import SettingsScreen  # noqa: E402
from edgellm.tui.session import ChatSettings  # noqa: E402
from edgellm.tui.widgets.chat import AssistantMessage, ChatLog, Notice, UserMessage  # noqa: E402
from edgellm.tui.widgets.layer_map import LayerMap  # noqa: E402
from edgellm.tui.widgets.memory_bar import MemoryBar, bar_cells, format_bytes  # noqa: E402
from edgellm.tui.widgets.stats_panel import DeviceTiming  # noqa: E402

LONG_REPLY = " ".join(f"word{i}" for i in range(400))


def run(coro):
    return asyncio.run(coro)


async def wait_for(pilot, predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)


async def ask(pilot, text: str) -> None:
    """Type `text` and submit it, as enter does. (`pilot.press("enter")` would also wait for the
    process to go idle, up to a second, which lets a fast fake answer finish before we look.)"""
    prompt = pilot.app.screen.query_one("#prompt", Input)
    prompt.value = text
    await prompt.action_submit()
    await asyncio.sleep(0)


async def ask_and_wait(pilot, text: str, timeout: float = 30.0) -> AssistantMessage:
    screen = pilot.app.screen
    request = screen.generation_id + 1
    await ask(pilot, text)
    await wait_for(pilot, lambda: screen.generation_id == request, what="the request to start")
    answer = screen.answer
    await wait_for(pilot, lambda: not screen.busy, timeout, "the answer to finish")
    return answer


def label(screen, widget_id: str) -> str:
    return str(screen.query_one(f"#{widget_id}", Static).content)


# --- chat ----------------------------------------------------------------------------------------
def test_prompt_streams_into_chat_and_conversation_is_multi_turn():
    fake = FakeModel(delay_s=0.03)
    n_tokens = len(fake.tokens())

    async def scenario():
        app = ChatApp(fake, ChatSettings(system_prompt="Be brief.", temperature=0.3, max_tokens=100))
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            await ask(pilot, "What is edgellm?")
            await wait_for(pilot, lambda: screen.generating and screen.answer is not None, what="start")
            answer = screen.answer
            # streaming: part of the answer is shown while the model is still generating
            await wait_for(pilot, lambda: len(answer.text) > 0, what="first token")
            partial = answer.text
            assert screen.generating and DEFAULT_REPLY.startswith(partial) and partial != DEFAULT_REPLY
            await wait_for(pilot, lambda: not screen.busy, what="end of answer")
            assert answer.text == DEFAULT_REPLY
            assert answer.markdown_source == DEFAULT_REPLY
            assert answer.finished
            assert [m.text for m in screen.query(UserMessage)] == ["What is edgellm?"]
            assert fake.calls[0]["messages"] == [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is edgellm?"},
            ]
            assert fake.calls[0]["temperature"] == 0.3 and fake.calls[0]["max_tokens"] == 100
            assert fake.tokens_streamed == n_tokens and fake.streams_closed == 1

            await ask_and_wait(pilot, "And then?")
            assert fake.calls[1]["messages"] == [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is edgellm?"},
                {"role": "assistant", "content": DEFAULT_REPLY},
                {"role": "user", "content": "And then?"},
            ]
            assert len(screen.query(AssistantMessage)) == 2

    run(scenario())


def test_escape_stops_generation_keeps_partial_answer_and_worker_ends():
    fake = FakeModel(LONG_REPLY, delay_s=0.05)

    async def scenario():
        app = ChatApp(fake, ChatSettings(max_tokens=400))
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            await ask(pilot, "Count for me.")
            await wait_for(pilot, lambda: screen.answer is not None and len(screen.answer.text.split()) >= 3,
                           what="three tokens")
            answer, worker = screen.answer, screen.worker
            await pilot.press("escape")
            await wait_for(pilot, lambda: not screen.busy, what="the stop to be noted")
            partial = answer.text
            assert 3 <= len(partial.split()) < 400 and LONG_REPLY.startswith(partial)
            notices = [n.text for n in screen.query(Notice)]
            assert notices == ["Stopped."]
            assert screen.session.turns[-1] == {"role": "assistant", "content": partial}
            # the worker thread leaves the model: the generator is closed, no more tokens come
            await wait_for(pilot, lambda: fake.streams_closed == 1 and not fake.streaming.is_set(),
                           timeout=5, what="the generator to close")
            assert worker.is_finished
            streamed = fake.tokens_streamed
            await pilot.pause(0.3)
            # (the screen drops chunks that were generated but not yet shown when Esc came)
            assert fake.tokens_streamed == streamed and len(partial.split()) <= streamed < 400
            assert answer.text == partial and answer.markdown_source == partial
            # and the chat goes on, with the partial answer in the history
            fake.reply = "fine."
            await ask_and_wait(pilot, "ok")
            assert fake.calls[1]["messages"][-2:] == [
                {"role": "assistant", "content": partial}, {"role": "user", "content": "ok"}]

    run(scenario())


def test_ctrl_n_starts_a_new_chat():
    fake = FakeModel(delay_s=0.01)

    async def scenario():
        app = ChatApp(fake)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            await ask_and_wait(pilot, "first question")
            assert len(screen.query_one(ChatLog).children) == 2
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert len(screen.query_one(ChatLog).children) == 0
            assert screen.session.turns == []
            assert label(screen, "tps") == "– tok/s" and label(screen, "ctx") == "ctx 0 / 512"
            assert len(screen.query(DeviceTiming)) == 0
            await ask_and_wait(pilot, "second question")
            assert fake.calls[-1]["messages"] == [{"role": "user", "content": "second question"}]

    run(scenario())


def test_ctrl_n_during_generation_discards_the_answer():
    fake = FakeModel(LONG_REPLY, delay_s=0.03)

    async def scenario():
        app = ChatApp(fake, ChatSettings(max_tokens=400))
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            await ask(pilot, "go")
            await wait_for(pilot, lambda: screen.answer is not None and screen.answer.text, what="a token")
            await pilot.press("ctrl+n")
            await wait_for(pilot, lambda: fake.streams_closed == 1, timeout=5, what="the generator to close")
            await pilot.pause(0.1)
            assert not screen.generating and screen.session.turns == []
            assert len(screen.query_one(ChatLog).children) == 0

    run(scenario())


@pytest.mark.parametrize("delay_s", [0.01, 0.05])
def test_quitting_during_generation_is_clean(delay_s):
    fake = FakeModel(LONG_REPLY, delay_s=delay_s)

    async def scenario():
        app = ChatApp(fake, ChatSettings(max_tokens=400))
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            await ask(pilot, "go")
            await wait_for(pilot, lambda: screen.answer is not None and screen.answer.text, what="a token")
            await pilot.press("ctrl+q")
        return app

    app = run(scenario())       # run_test re-raises anything the app raised while closing
    assert app.return_code == 0
    deadline = time.monotonic() + 5
    while fake.streaming.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.streams_closed == 1 and fake.tokens_streamed < 400


# --- side panel ----------------------------------------------------------------------------------
def test_panel_figures_bars_layer_map_and_sparklines_follow_the_model(monkeypatch):
    from edgellm import machine

    monkeypatch.setattr(machine, "machine_bandwidth", lambda threads: 25e9)  # the stream test, as if cached
    fake = FakeModel(delay_s=0.08, gpu_layers=12)     # ~2 s of streaming: several panel refreshes
    n_tokens = len(fake.tokens())
    n_prompt = count_tokens([{"role": "user", "content": "hi"}])

    async def scenario():
        app = ChatApp(fake)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            layer_map = screen.query_one(LayerMap)
            assert layer_map.layers == ("gpu",) * 12 + ("cpu",) * 18 and layer_map.output_device == "cpu"
            assert label(screen, "model-name") == "FakeLM-135M"
            await ask(pilot, "hi")
            # while generating, the context figure moves past the prompt but not yet to the end
            await wait_for(pilot, lambda: screen.generating, what="generation to start")
            seen = set()
            while screen.busy:
                seen.add(label(screen, "ctx"))
                await pilot.pause(0.05)
            middle = {f"ctx {n} / 512" for n in range(n_prompt + 1, n_prompt + n_tokens)}
            assert seen & middle, seen
            await pilot.pause(0.3)      # one more panel refresh
            stats = fake.stats
            assert label(screen, "tps") == f"{stats.gen_tps:.1f} tok/s"
            assert label(screen, "tpot") == f"TPOT {stats.tpot_ms:.1f}ms"
            assert label(screen, "ttft") == f"TTFT {stats.ttft_s:.2f}s"
            assert label(screen, "ctx") == f"ctx {n_prompt + n_tokens} / 512"
            ram = screen.query_one("#ram-bar", MemoryBar)
            cpu = stats.memory["cpu"]
            assert ram.segments == {"weights": cpu["weights"], "kv_cache": cpu["kv_cache"],
                                    "other": cpu["activations"] + cpu["runtime"]}
            assert ram.capacity >= sum(ram.segments.values()) and ram.title.startswith("RAM  rss ")
            vram = screen.query_one("#vram-bar", MemoryBar)
            assert vram.display and vram.segments["weights"] == stats.memory["gpu"]["weights"]
            # one sparkline per device, one point per token, the fake's ms values in order
            rows = {row.device: row for row in screen.query(DeviceTiming)}
            assert set(rows) == {"cpu", "gpu", "transfer"}
            expected_cpu = [1000 * fake.delay_s * (0.6 + 0.1 * (i % 4)) for i in range(n_tokens)]
            assert rows["cpu"].query_one(Sparkline).data == pytest.approx(expected_cpu)
            assert rows["transfer"].query_one(Sparkline).data == pytest.approx([0.2] * n_tokens)
            assert str(rows["cpu"].query_one(Static).content).endswith(f"{expected_cpu[-1]:.1f}ms")
            # the CPU's weights per step over its mean ms of the last 16 tokens, against the stream test
            recent = expected_cpu[-16:]
            rate = fake.weights_read_per_token()["cpu"] / (sum(recent) / len(recent) / 1000)
            gbs = f"{rate / 1e9:.0f}" if rate >= 10e9 else f"{rate / 1e9:.1f}"
            assert label(screen, "timing-heading") == f"ms / token  cpu {gbs} GB/s {100 * rate / 25e9:.0f}%"

    run(scenario())


def test_hostile_model_name_is_shown_literally_and_escaped():
    """general.name comes from the file: markup must stay text, control/bidi characters escaped."""
    from textual.widgets._header import HeaderTitle

    from edgellm.errors import printable

    hostile = "[bold red]Evil[/] [link=https://x.example]click[/link]\x1b]0;pwned\x07\x1b[2J\nline2\u202egnp.exe"
    fake = FakeModel(delay_s=0.01)
    fake.metadata["general.name"] = hostile
    shown = printable(hostile)
    assert "[bold red]Evil[/]" in shown and "\\x1b]0;pwned\\x07" in shown and "\\u202e" in shown

    async def scenario():
        app = ChatApp(fake)
        async with app.run_test(size=(120, 24)) as pilot:
            screen = app.screen
            await pilot.pause()
            assert label(screen, "model-name") == shown
            assert screen.sub_title == shown
            title = str(screen.query_one(HeaderTitle).content)
            assert title.endswith(shown) and "\x1b" not in title and "\n" not in title
            await ask_and_wait(pilot, "hi")  # the chat goes on with the name as is
            assert label(screen, "model-name") == shown

    run(scenario())


def test_markdown_flush_slows_down_as_the_answer_grows():
    from edgellm.tui.widgets.chat import FLUSH_BASE_S, FLUSH_BLOCKS_PER_STEP, FLUSH_MAX_S, flush_interval

    assert flush_interval(0) == FLUSH_BASE_S
    assert flush_interval(FLUSH_BLOCKS_PER_STEP) == pytest.approx(2 * FLUSH_BASE_S)
    assert flush_interval(10_000) == FLUSH_MAX_S


def test_memory_bar_cells_and_sizes():
    assert bar_cells([50, 25, 0], 100, 20) == [10, 5, 0]
    assert bar_cells([1, 0, 0], 1000, 20) == [1, 0, 0]          # a tiny segment stays visible
    assert bar_cells([300, 300, 300], 900, 10) == [3, 4, 3]     # rounding the running total
    assert bar_cells([5, 5], 0, 10) == [0, 0]
    assert format_bytes(512) == "512B" and format_bytes(98 * 1024**2) == "98M"
    assert format_bytes(1.5 * 1024**3) == "1.5G" and format_bytes(3.4 * 1024**2) == "3.4M"


# --- context full --------------------------------------------------------------------------------
def test_context_full_at_prompt_shows_a_message_and_the_chat_goes_on():
    fake = FakeModel(delay_s=0.01, n_ctx=20)

    async def scenario():
        app = ChatApp(fake)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            await ask_and_wait(pilot, " ".join(["long"] * 30))
            notices = list(screen.query(Notice))
            assert len(notices) == 1 and notices[0].has_class("context-full")
            assert "Context full" in notices[0].text and "ctrl+n" in notices[0].text
            assert "context holds 20" in notices[0].text      # the model's own explanation
            assert screen.session.turns == []         # the question that did not fit is dropped
            assert not screen.query(AssistantMessage)
            fake.reply = "short"
            answer = await ask_and_wait(pilot, "hi")
            assert answer.text == "short"

    run(scenario())


def test_context_full_during_answer_keeps_the_partial_answer():
    fake = FakeModel(LONG_REPLY, delay_s=0.005, n_ctx=15)
    n_prompt = count_tokens([{"role": "user", "content": "hi"}])

    async def scenario():
        app = ChatApp(fake, ChatSettings(max_tokens=400))
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            answer = await ask_and_wait(pilot, "hi")
            assert len(answer.text.split()) == 15 - n_prompt
            notices = list(screen.query(Notice))
            assert [n.has_class("context-full") for n in notices] == [True]
            assert "filled all 15 tokens" in notices[0].text and "ctrl+n" in notices[0].text
            assert screen.session.turns[-1] == {"role": "assistant", "content": answer.text}

    run(scenario())


# --- settings, loading, layout -------------------------------------------------------------------
def test_settings_screen_edits_what_the_next_answer_uses():
    fake = FakeModel(delay_s=0.01)

    async def scenario():
        app = ChatApp(fake)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("f2")
            await pilot.pause()
            dialog = app.screen
            assert isinstance(dialog, SettingsScreen)
            dialog.query_one("#temperature", Input).value = "-1"
            await pilot.click("#save")
            await pilot.pause()
            assert app.screen is dialog
            assert "temperature must be >= 0" in str(dialog.query_one("#settings-error", Static).content)
            dialog.query_one("#system_prompt", Input).value = "You are terse."
            dialog.query_one("#temperature", Input).value = "0.2"
            dialog.query_one("#top_p", Input).value = "0.5"
            max_tokens = dialog.query_one("#max_tokens", Input)
            max_tokens.value = "5"
            max_tokens.focus()
            await pilot.press("enter")      # enter in any field saves too
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            assert (screen.settings.temperature, screen.settings.top_p, screen.settings.max_tokens) == (0.2, 0.5, 5)
            answer = await ask_and_wait(pilot, "hi")
            assert answer.text == "".join(fake.tokens()[:5])
            call = fake.calls[-1]
            assert (call["temperature"], call["top_p"], call["max_tokens"]) == (0.2, 0.5, 5)
            assert call["messages"][0] == {"role": "system", "content": "You are terse."}

    run(scenario())


def test_loader_runs_in_a_worker_behind_a_loading_screen():
    import threading

    loaded = FakeModel(delay_s=0.01)
    release = threading.Event()  # the load finishes when the test has seen the loading screen

    def slow_loader():
        release.wait(30)
        return loaded

    async def scenario():
        app = ChatApp(slow_loader)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.1)
            assert type(app.screen).__name__ == "LoadingScreen"
            release.set()
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.is_mounted,
                           what="the chat screen")
            assert app.model is loaded
            answer = await ask_and_wait(pilot, "hi")
            assert answer.text == DEFAULT_REPLY

    run(scenario())


def test_loader_error_exits_the_app_with_the_error():
    from edgellm.errors import ModelNotFoundError

    def failing_loader():
        raise ModelNotFoundError("no such model 'nope'; run `edgellm pull NAME` or give a .gguf path")

    async def scenario():
        app = ChatApp(failing_loader)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.load_error is not None, what="the load error")
        assert isinstance(app.load_error, ModelNotFoundError) and app.return_code == 1

    run(scenario())


def test_layout_fits_80x24_and_survives_resizes():
    fake = FakeModel(delay_s=0.01, gpu_layers=30)

    async def scenario():
        app = ChatApp(fake)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            await ask_and_wait(pilot, "hi")
            await pilot.pause(0.3)
            panel, column = screen.query_one("#stats-panel"), screen.query_one("#chat-column")
            assert panel.region.width == 30 and column.region.width == 50
            prompt = screen.query_one("#prompt", Input)
            assert prompt.region.bottom <= 23 and prompt.region.height == 3     # above the footer
            # every panel row is on screen without scrolling at 80x24
            for widget_id in ("model-name", "ram-bar", "vram-bar", "layer-map", "ttft", "tps", "ctx", "timing-heading"):
                region = screen.query_one(f"#{widget_id}").region
                assert region.height > 0 and region.bottom <= 23, widget_id
            for size in ((60, 20), (120, 40), (80, 24)):
                await pilot.resize_terminal(*size)
                await pilot.pause()
            assert screen.query_one("#stats-panel").region.width == 30
        assert app.return_code in (0, None)

    run(scenario())


def test_chat_command_arguments():
    from edgellm.commands import chat

    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    args = parser.parse_args(["model.gguf", "-ngl", "auto", "-c", "2048", "-t", "2", "--temp", "0.2",
                              "--top-k", "10", "--top-p", "0.5", "--min-p", "0.1", "--repeat-penalty", "1.1",
                              "--seed", "7", "--system", "Be brief.", "-n", "64"])
    assert (args.model, args.gpu_layers, args.ctx, args.threads) == ("model.gguf", "auto", 2048, 2)
    assert (args.temp, args.top_k, args.top_p, args.min_p, args.repeat_penalty, args.seed) == (0.2, 10, 0.5, 0.1, 1.1, 7)
    assert (args.system, chat._max_tokens(args)) == ("Be brief.", 64)
    assert parser.parse_args(["--gpu-layers", "-1"]).gpu_layers == -1
    assert chat._max_tokens(argparse.Namespace(n=-1)) == chat.DEFAULT_MAX_TOKENS
    with pytest.raises(SystemExit):
        parser.parse_args(["--gpu-layers", "most"])


def test_chat_command_refuses_to_draw_into_a_pipe(monkeypatch):
    from edgellm.commands import chat
    from edgellm.errors import InvalidArgumentError

    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    with pytest.raises(InvalidArgumentError, match="needs a terminal"):
        chat.run(parser.parse_args([]))


# --- the real default model ----------------------------------------------------------------------
@pytest.mark.real
@pytest.mark.slow
def test_real_default_model_answers_in_the_chat():
    import edgellm

    model = edgellm.load(n_ctx=512)

    async def scenario():
        app = ChatApp(model, ChatSettings(temperature=0.0, max_tokens=16))
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            answer = await ask_and_wait(pilot, "What is the capital of France?", timeout=180)
            await pilot.pause(0.3)
            stats = model.stats
            assert answer.text.strip() and answer.markdown_source == answer.text
            assert 1 <= stats.gen_tokens <= 16 and stats.gen_tps > 0
            assert stats.prompt_tokens < stats.n_past <= stats.prompt_tokens + stats.gen_tokens
            assert label(screen, "ctx") == f"ctx {stats.n_past} / 512"
            assert label(screen, "tps") == f"{stats.gen_tps:.1f} tok/s"
            ram = screen.query_one("#ram-bar", MemoryBar)
            assert ram.segments["weights"] == stats.memory["cpu"]["weights"] > 0
            assert screen.query_one(LayerMap).layers == tuple(model.plan.layers)
            assert screen.query(DeviceTiming).first().device == "cpu"
            return answer.text

    shown = run(scenario())
    # greedy decoding: the chat shows exactly what the API streams for the same conversation
    direct = model.chat([{"role": "user", "content": "What is the capital of France?"}],
                        temperature=0.0, max_tokens=16)
    assert shown == "".join(chunk.text for chunk in direct)


@pytest.mark.real
def test_the_panel_shows_drafted_and_kept_tokens(smollm2_path, monkeypatch):
    """Speculative decoding (prompt lookup, every step verifying): the panel's context line says how
    many proposed tokens the answer kept, the engine's own counts."""
    import edgellm
    from edgellm import scheduler

    monkeypatch.setattr(scheduler.DraftLength, "choose", lambda self, available: available)
    model = edgellm.load(smollm2_path, n_ctx=512, spec_type="ngram-simple")

    async def scenario():
        app = ChatApp(model, ChatSettings(temperature=0.0, max_tokens=48))
        async with app.run_test(size=(80, 24)) as pilot:
            await ask_and_wait(pilot, "Repeat exactly: the red fox and the red fox and the red fox and the red fox",
                               timeout=120)
            await pilot.pause(0.3)
            stats = model.stats
            assert stats.draft_n > 0
            assert label(app.screen, "ctx") == (f"ctx {stats.n_past} / 512  draft {stats.draft_n_accepted}/"
                                                f"{stats.draft_n}")

    try:
        run(scenario())
    finally:
        model.close()


def test_the_layer_map_draws_a_split_block():
    """A mixture-of-experts block with its attention on the GPU and its experts on the CPU
    (--cpu-moe, --n-cpu-moe) is drawn apart from the blocks wholly on one device."""
    m = LayerMap()
    m.layers, m.experts, m.output_device = ("cpu",) + ("gpu",) * 4, ("cpu",) * 3 + ("gpu",) * 2, "gpu"
    assert m.cells() == ["cpu", "split", "split", "gpu", "gpu"]
    assert m.render().plain.splitlines()[0] == "Layers █gpu2 ▓split2 ▒cpu1 →gpu"
    m.experts = ()  # a dense model
    assert m.cells() == ["cpu"] + ["gpu"] * 4
