"""The quickstart's conversation: multi-turn chats through a local gateway with the openai SDK,
printing for each request the provider that served it and why.

What it shows: a new session pins to the first own provider and stays (its prefix cache hits
grow); a burst beyond the session's in-flight slots is offloaded once while the pin stays; an
operator drain moves the session by compare-and-swap repin.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

MODEL = "llama-3.1-70b"
SYSTEM = (
    "You are a concise assistant for the platform team. Answer in one short paragraph, cite the "
    "runbook section when you can, and never invent numbers you were not given."
)


class Conversation:
    """One user's chat session through the gateway."""

    def __init__(self, base_url: str, user: str):
        self.user = user
        self.client = OpenAI(base_url=f"{base_url}/v1", api_key="demo", default_headers={"x-user-id": user}, max_retries=0)
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Hello, I am {user}."}]
        self.turns = 0

    def ask(self, label: str = "", max_tokens: int = 12) -> tuple[str, str]:
        """Send the conversation so far; print who served it and why. Returns (provider, reason)."""
        raw = self.client.chat.completions.with_raw_response.create(model=MODEL, messages=self.messages, max_tokens=max_tokens)
        completion = raw.parse()
        provider, reason = raw.headers.get("x-iris-provider", "?"), raw.headers.get("x-iris-route-reason", "?")
        details = completion.usage.prompt_tokens_details
        cached = details.cached_tokens if details else 0
        print(
            f"  {self.user:<6} {label or 'turn ' + str(self.turns + 1):<14} -> {provider:<8} {reason:<10}"
            f" prompt {completion.usage.prompt_tokens:>3} tokens, {cached:>3} from prefix cache"
        )
        return provider, reason

    def advance(self, answer: str = "ok") -> None:
        self.turns += 1
        self.messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And then, step {self.turns + 1}?"}]


def run_demo(base_url: str, config_path: str) -> list[tuple[str, str]]:
    """The whole demo against the gateway at `base_url` whose ext_proc uses `config_path`."""
    seen = []
    alice, bob = Conversation(base_url, "alice"), Conversation(base_url, "bob")
    print("Two conversations, three turns each: each session pins to the first own provider.")
    for conversation in (alice, bob):
        for _ in range(3):
            seen.append(conversation.ask())
            conversation.advance()

    print("A burst of 3 parallel requests from alice (2 in-flight slots per session): one is offloaded.")
    with ThreadPoolExecutor(3) as pool:
        seen += list(pool.map(lambda i: alice.ask(f"burst {i + 1}", max_tokens=40), range(3)))

    print("The operator drains iris-1: alice's session moves by compare-and-swap repin.")
    _cli("drain", "iris-1", "--config", config_path)
    time.sleep(1.5)  # every proxy picks up the flag within one refresh interval (1 s)
    seen.append(alice.ask())
    alice.advance()
    _cli("undrain", "iris-1", "--config", config_path)
    time.sleep(1.5)
    seen.append(alice.ask("after undrain"))
    print("alice stays on her new pin: moving back would throw away the prefix cache.")
    return seen


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "extproc.cli", "--log-level", "warning", *args], check=True)
