"""Locust scenario against a served bundle: users with stable ids (so stickiness matters), short and
long task prompts, completions and chat, some streaming.

Run headless, bounded in time, loopback only:
    .venv/bin/locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 60s --host http://127.0.0.1:3000
Never import this module into a process that runs vLLM or Monarch (Locust monkey-patches with gevent).
"""

from __future__ import annotations

import itertools
import random

from locust import HttpUser, between, task

from quantize.task import rollout_prompts

PROMPTS = rollout_prompts(512)
SHORT = [p for p in PROMPTS if len(p) <= 6]
LONG = [p for p in PROMPTS if len(p) > 6]
_ids = itertools.count()


class PolicyClient(HttpUser):
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.user_id = f"locust-user-{next(_ids)}"  # stable per simulated user: sticky routing applies

    def _prompt(self) -> str:
        return random.choice(SHORT if random.random() < 0.5 else LONG)

    @task(5)
    def completion(self) -> None:
        body = {"model": "policy", "prompt": self._prompt(), "max_tokens": 6, "temperature": 0, "user": self.user_id}
        with self.client.post("/v1/completions", json=body, name="completions", catch_response=True) as r:
            if r.status_code != 200 or "policy_variant" not in r.json():
                r.failure(f"status {r.status_code}")

    @task(3)
    def chat(self) -> None:
        body = {"model": "policy", "messages": [{"role": "user", "content": self._prompt()}], "max_tokens": 6,
                "temperature": 0, "user": self.user_id}
        self.client.post("/v1/chat/completions", json=body, name="chat")

    @task(2)
    def streaming(self) -> None:
        body = {"model": "policy", "prompt": self._prompt(), "max_tokens": 6, "temperature": 0, "stream": True,
                "user": self.user_id}
        with self.client.post("/v1/completions", json=body, name="completions (stream)", stream=True,
                              catch_response=True) as r:
            chunks = [line for line in r.iter_lines() if line]
            if r.status_code != 200 or not chunks or chunks[-1] != b"data: [DONE]":
                r.failure(f"status {r.status_code}, {len(chunks)} chunks")
