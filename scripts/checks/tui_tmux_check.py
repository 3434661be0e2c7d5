#!/usr/bin/env python3
"""Drive the real chat UI in an 80x24 tmux pane, as a user would, and check what the screen shows.

    python scripts/checks/tui_tmux_check.py                 # `edgellm chat` on the default model
    python scripts/checks/tui_tmux_check.py --model PATH    # another GGUF file or known name
    python scripts/checks/tui_tmux_check.py --command run   # `edgellm run` (no -p on a terminal: the chat)
    python scripts/checks/tui_tmux_check.py --fake          # the app on tests/fake_engine.FakeModel

Steps: start the app in a shell in tmux, wait for the chat, send a prompt, check that the answer
streams (the chat column changes between captures) and that the panel shows memory, layers and
timing figures; Esc stops the answer ("Stopped.", no more text); ctrl+n clears; resizes to 120x40 and
back to 80x24; ctrl+q quits with exit code 0, no traceback, alternate screen / mouse tracking off
and the cursor visible; then the app is started again with --resume and the stopped exchange must be
on screen again (the chats are kept in a fresh XDG_DATA_HOME). Exit code 0 when every check passed.
Needs tmux (apt-get install tmux).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTH, HEIGHT = 80, 24
CHAT_COLUMNS = 50               # the chat column at 80 columns; the panel is the rest
EXIT_MARKER = "EDGELLM_EXIT="
PROMPT = "Write a long story about a robot who learns to paint. Use many paragraphs."


class CheckFailed(Exception):
    pass


class Pane:
    def __init__(self, session: str) -> None:
        self.session = session

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout

    def capture(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.session)

    def chat_column(self) -> str:
        return "\n".join(line[:CHAT_COLUMNS] for line in self.capture().splitlines())

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.session, *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", self.session, "-l", text)

    def flag(self, name: str) -> str:
        return self.tmux("display-message", "-p", "-t", self.session, f"#{{{name}}}").strip()

    def wait_for(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.capture()
            if "Traceback" in screen:
                raise CheckFailed(f"a traceback is on screen while waiting for {what}:\n{screen}")
            if predicate(screen):
                return screen
            if time.monotonic() > deadline:
                raise CheckFailed(f"timed out after {timeout:.0f}s waiting for {what}; the pane shows:\n{screen}")
            time.sleep(0.2)


def check(condition: bool, message: str, screen: str = "") -> None:
    if not condition:
        raise CheckFailed(message + (f"\n{screen}" if screen else ""))
    print(f"  ok  {message}")


def app_command(args: argparse.Namespace, resume: bool = False) -> str:
    if args.fake:
        fake = Path(__file__).resolve().parents[2] / "tests" / "fake_engine.py"
        return shlex.join([sys.executable, str(fake), "--delay", "0.05", "--repeat", "30"]
                          + (["--resume"] if resume else []))
    edgellm = shutil.which("edgellm")
    base = [edgellm] if edgellm else [sys.executable, "-m", "edgellm.cli"]
    model = [args.model] if args.model else []
    # `run` without -p opens the chat but has no --resume: the resumed session is `chat`
    command = "chat" if resume else args.command
    return shlex.join(base + [command, *model, *args.extra] + (["--resume"] if resume else []))


def answer_tail(column: str) -> str:
    """A fragment of the last answer line above "Stopped." in the chat column (border and padding
    stripped), to find on screen again after --resume."""
    lines = column.splitlines()
    end = next(i for i, line in enumerate(lines) if "Stopped." in line)
    for line in reversed(lines[:end]):
        text = line.strip(" ▌▎▍│┃").strip()
        if len(text) >= 8:
            return text[:24]
    raise CheckFailed(f"no answer text above 'Stopped.':\n{column}")


def run_checks(pane: Pane, load_timeout: float) -> None:
    pane.wait_for(lambda s: "Ask something" in s and "RAM" in s, load_timeout, "the chat screen")
    check(True, "the chat opened")

    pane.type(PROMPT)
    pane.keys("Enter")
    pane.wait_for(lambda s: re.search(r"\d+\.\d tok/s", s), 300, "the first streamed tokens")
    first = pane.chat_column()
    pane.wait_for(lambda s: pane.chat_column() != first, 60, "more streamed text")
    check(True, "the answer streams (the chat column grows while generating)")
    screen = pane.capture()
    for needle in ("rss", "■W", "■KV", "Layers", "ms / token", "TTFT", "TPOT", "tok/s"):
        check(needle in screen, f"the panel shows {needle!r}", screen)
    bw = re.search(r"ms / token  cpu ([\d.]+) GB/s(?: (\d+)%)?", screen)
    check(bw is not None and float(bw[1]) > 0, f"the timing heading shows the weight bandwidth ({bw and bw[0]})", screen)
    ctx = re.search(r"ctx (\d+) / (\d+)", screen)
    check(ctx is not None and 0 < int(ctx[1]) <= int(ctx[2]), f"the context figure is filled ({ctx and ctx[0]})", screen)
    check("Write a long story" in screen, "the question is shown", screen)

    pane.keys("Escape")
    pane.wait_for(lambda s: "Stopped." in s, 30, "'Stopped.' after Esc")
    before = pane.chat_column()
    time.sleep(1.5)
    check(pane.chat_column() == before, "Esc stopped the answer (no more text after 1.5 s)")
    tail = answer_tail(pane.chat_column())

    pane.keys("C-n")
    pane.wait_for(lambda s: "Stopped." not in s and "– tok/s" in s, 10, "an empty chat after ctrl+n")
    check(True, "ctrl+n cleared the chat")

    pane.tmux("resize-window", "-t", pane.session, "-x", "120", "-y", "40")
    time.sleep(1.0)
    pane.tmux("resize-window", "-t", pane.session, "-x", str(WIDTH), "-y", str(HEIGHT))
    screen = pane.wait_for(lambda s: "Ask something" in s, 10, "the chat after resizing")
    check("Traceback" not in screen, "resizing to 120x40 and back to 80x24 is fine")

    pane.keys("C-q")
    screen = pane.wait_for(lambda s: re.search(EXIT_MARKER + r"\d", s), 30, "the app to exit")
    code = re.search(EXIT_MARKER + r"(\d+)", screen)
    check(code is not None and code[1] == "0", f"ctrl+q quits with exit code 0 ({code and code[0]})", screen)
    check("Traceback" not in screen and "Ask something" not in screen and "tok/s" not in screen,
          "the terminal shows no leftovers of the app", screen)
    check(pane.flag("alternate_on") == "0", "the alternate screen is off")
    mouse = [pane.flag(f) for f in ("mouse_any_flag", "mouse_all_flag", "mouse_button_flag",
                                    "mouse_standard_flag", "mouse_sgr_flag")]
    check(set(mouse) == {"0"}, "mouse tracking is off")
    check(pane.flag("cursor_flag") == "1", "the cursor is visible")
    return tail


def check_resume(pane: Pane, command: str, tail: str, load_timeout: float) -> None:
    pane.type(f"clear; {command}; echo {EXIT_MARKER}$?")
    pane.keys("Enter")
    screen = pane.wait_for(lambda s: "Ask something" in s and tail in s, load_timeout,
                           f"the kept exchange after --resume (answer text {tail!r})")
    check(True, f"--resume shows the previous exchange again ({tail!r})")
    pane.keys("C-q")
    screen = pane.wait_for(lambda s: re.search(EXIT_MARKER + r"\d", s), 30, "the resumed app to exit")
    check(re.search(EXIT_MARKER + "0", screen) is not None, "the resumed app quits with exit code 0", screen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="MODEL for `edgellm chat` (default: the default model)")
    parser.add_argument("--command", choices=("chat", "run"), default="chat",
                        help="open the UI with `edgellm chat` (default) or `edgellm run` without -p")
    parser.add_argument("--fake", action="store_true", help="run the app on the fake engine instead")
    parser.add_argument("--load-timeout", type=float, default=300, help="seconds to wait for the chat to open")
    parser.add_argument("--keep", action="store_true", help="leave the tmux session running afterwards")
    parser.add_argument("extra", nargs="*", help="more `edgellm chat` flags (after --)")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        print("tmux is not installed: apt-get install -y tmux", file=sys.stderr)
        return 2

    session = f"edgellm-tui-check-{os.getpid()}"
    data_home = tempfile.mkdtemp(prefix="edgellm-tui-check-data-")  # the kept chats of this check
    env = f"XDG_DATA_HOME={shlex.quote(data_home)} "
    command = env + app_command(args)
    print(f"tmux {WIDTH}x{HEIGHT}: {command}")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", str(WIDTH), "-y", str(HEIGHT),
                    "sh"], check=True)
    pane = Pane(session)
    try:
        pane.type(f"{command}; echo {EXIT_MARKER}$?")
        pane.keys("Enter")
        tail = run_checks(pane, args.load_timeout)
        check_resume(pane, env + app_command(args, resume=True), tail, args.load_timeout)
    except CheckFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
            shutil.rmtree(data_home, ignore_errors=True)
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
