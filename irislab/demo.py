"""The quickstart's conversation: multi-turn chats through a local gateway with the openai SDK,
printing for each request the provider that served it and why.

What it shows: a new session pins to the first own provider and stays (its prefix cache hits
grow); a burst beyond the session's in-flight slots is offloaded once while the pin stays; an
operator drain moves the session by compare-and-swap repin; a Responses API conversation chained
by `previous_response_id` stays on the provider that stores its responses.

Each user has an API key of their own: with no authenticating filter in front of the demo, the
key is the client's identity (the router hashes it, keyed, before it removes it), so users with
the same opening message still get sessions of their own.
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
        self.client = OpenAI(base_url=f"{base_url}/v1", api_key=f"demo-key-{user}", max_retries=0)
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


def responses_conversation(base_url: str, user: str, turns: int = 4) -> list[tuple[str, str]]:
    """A Responses API conversation: each turn sends only its new input and the previous
    response's id; print who served it and why. Returns (provider, reason) per turn."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key=f"demo-key-{user}", max_retries=0)
    previous, seen = None, []
    for turn in range(turns):
        chained = {"previous_response_id": previous} if previous else {"instructions": SYSTEM}
        raw = client.responses.with_raw_response.create(
            model=MODEL, input=f"Step {turn + 1}, please.", max_output_tokens=12, **chained
        )
        response = raw.parse()
        provider, reason = raw.headers.get("x-iris-provider", "?"), raw.headers.get("x-iris-route-reason", "?")
        cached = response.usage.input_tokens_details.cached_tokens
        after = f"after {previous[:13]}" if previous else "new chain"
        print(
            f"  {user:<6} {'response ' + str(turn + 1):<14} -> {provider:<8} {reason:<10}"
            f" input {response.usage.input_tokens:>3} tokens, {cached:>3} from prefix cache ({after})"
        )
        previous = response.id
        seen.append((provider, reason))
    return seen


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

    print("A Responses API conversation chained by previous_response_id: one session, on the provider storing it.")
    seen += responses_conversation(base_url, "dana")
    return seen


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "extproc.cli", "--log-level", "warning", *args], check=True)
