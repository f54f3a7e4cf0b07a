"""Locust scenario against a served bundle: users with stable ids (so stickiness matters), short and
long task prompts, completions and chat, some streaming.

Run headless, bounded in time and in requests, loopback only:
    .venv/bin/locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 60s --max-requests 2000 \
        --host http://127.0.0.1:3000
A host that is not loopback is refused unless ``--allow-non-loopback`` is given.
Never import this module into a process that runs vLLM or Monarch (Locust monkey-patches with gevent).
"""

from __future__ import annotations

import itertools
import random
import sys
from urllib.parse import urlparse

import gevent
from locust import HttpUser, between, events, task

from policy_bundle.quantize.reference.task import rollout_prompts

PROMPTS = rollout_prompts(512)
SHORT = [p for p in PROMPTS if len(p) <= 6]
LONG = [p for p in PROMPTS if len(p) > 6]
_ids = itertools.count()
_sent = itertools.count(1)
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_env = None  # the Locust environment, set on init


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0: no limit)")
    parser.add_argument("--allow-non-loopback", action="store_true", default=False,
                        help="allow a --host that is not 127.0.0.1/localhost/::1")


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    global _env
    _env = environment
    opts = environment.parsed_options
    host = urlparse(environment.host or "").hostname
    if opts and host and host not in LOOPBACK and not opts.allow_non_loopback:
        sys.stderr.write(f"locustfile: --host {environment.host} is not loopback; pass --allow-non-loopback to "
                         "load a remote server\n")
        sys.exit(2)


@events.request.add_listener
def _budget(**_kwargs) -> None:
    limit = _env.parsed_options.max_requests if _env and _env.parsed_options else 0
    if limit and next(_sent) == limit:  # the limit-th request: stop the users (those in flight finish)
        gevent.spawn(_env.runner.quit)


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
