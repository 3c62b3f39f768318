"""The quickstart's conversation: a few multi-turn chats through the gateway with the openai SDK,
printing for each request the provider that served it and why."""

from __future__ import annotations

from openai import OpenAI

MODEL = "llama-3.1-70b"
SYSTEM = "You are a concise assistant."


def run_conversation(base_url: str, turns: int = 3) -> list[tuple[str, str]]:
    """Run two users' conversations of `turns` turns. Returns (provider, reason) per request."""
    seen = []
    for user in ("alice", "bob"):
        client = OpenAI(base_url=f"{base_url}/v1", api_key="demo", default_headers={"x-user-id": user})
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Hello, I am {user}."}]
        for turn in range(1, turns + 1):
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8)
            completion = raw.parse()
            provider = raw.headers.get("x-iris-provider", "?")
            reason = raw.headers.get("x-iris-route-reason", "?")
            cached = completion.usage.prompt_tokens_details.cached_tokens if completion.usage.prompt_tokens_details else 0
            print(f"{user} turn {turn}: served by {provider:<8} ({reason}); prompt tokens {completion.usage.prompt_tokens}, cached {cached}")
            seen.append((provider, reason))
            messages += [
                {"role": "assistant", "content": completion.choices[0].message.content},
                {"role": "user", "content": f"Tell me more, turn {turn + 1}."},
            ]
    return seen
