"""The one place the serving processes meet the test faults (``bundle.faults``, ``POLICY_BUNDLE_TEST_FAULT``).

Each fault is read once, where a part is made, and installed as what that part is given: a per-step hook on an
engine's decode thread (``slow``, ``hang``), an engine wrapper (``fail``, ``stall``), a start-up refusal (``novllm``),
a loop tick that raises (``loop``), a chat template that raises (``template``). With no fault set each function
returns the part as it is, so no serving code branches on faults on its request path.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Optional

from policy_bundle.bundle.faults import active_fault, active_faults, announced_spec, fault_spec

log = logging.getLogger("policy_bundle.faults")
StepHook = Callable[[int], None]  # called on a decode thread before step n


def announced() -> Optional[str]:
    """The active fault spec, announced once per process (stderr and log), or None: for the router's status."""
    return announced_spec()


def spec() -> Optional[str]:
    """The active fault spec as set, or None (a variant's health reports it on every probe: read, not parsed)."""
    return fault_spec()


def step_hook(engine: str, hang_too: bool = True) -> Optional[StepHook]:
    """What an engine's decode thread runs before each step: ``slow`` sleeps that many seconds, ``hang[:name=]``
    blocks the thread for good from step ``after`` on (a batched engine whose name starts with ``name``; its health
    endpoint still answers, as with a hung kernel; ``hang_too`` False: an engine ``hang`` does not apply to). None
    without either."""
    slow, hang = active_fault("slow"), active_fault("hang") if hang_too else None
    hang_after = hang.after if hang is not None and (not hang.name or engine.startswith(hang.name)) else None
    if slow is None and hang_after is None:
        return None
    delay = slow.factor if slow is not None else 0.0

    def hook(step: int) -> None:
        if delay:
            time.sleep(delay)
        if hang_after is not None and step >= hang_after:
            log.error("%s: injected fault: the decode thread hangs at step %d", engine, step)
            threading.Event().wait()
    return hook


class FaultyEngine:
    """An engine whose ``generate`` raises after ``fail_after`` steps (``fail:after=N``; 0: before the first) and
    waits ``stalls[n]`` seconds before step n (``stall:after=n:factor=S``); everything else is the engine's."""

    def __init__(self, engine: Any, fail_after: Optional[int], stalls: Dict[int, float]):
        self._engine, self._fail_after, self._stalls = engine, fail_after, stalls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt_ids, params) -> AsyncIterator[Any]:
        n = 0
        async with aclosing(self._engine.generate(prompt_ids, params)) as steps:
            async for step in steps:
                self._check(n)
                if n in self._stalls:
                    await asyncio.sleep(self._stalls[n])
                n += 1
                yield step
        self._check(n)

    def _check(self, n: int) -> None:
        if self._fail_after is not None and n >= self._fail_after:
            raise RuntimeError(f"injected fault: generation fails after {self._fail_after} token(s)")


def with_faults(variant: str, engine: Any) -> Any:
    """``engine`` as the variant serves it: wrapped in ``FaultyEngine`` under a ``fail`` or ``stall`` fault that hits
    ``variant``, else itself."""
    fail = active_fault("fail", variant)
    stalls = {f.after: f.factor for f in active_faults("stall", variant)}
    if fail is None and not stalls:
        return engine
    return FaultyEngine(engine, fail.after if fail is not None else None, stalls)


def refuse_vllm() -> None:
    """Raise as a broken vLLM install would, under ``novllm``."""
    if active_fault("novllm"):
        raise RuntimeError("injected fault: vLLM failed to load")


def loop_tick(tick: Callable[[], Awaitable[None]], name: str) -> Callable[[], Awaitable[None]]:
    """A router loop's tick; under ``loop:name=<loop>:count=N`` its first N ticks raise."""
    fault = active_fault("loop", name)
    if fault is None:
        return tick
    raised = [0]

    async def run() -> None:
        if raised[0] < fault.count:
            raised[0] += 1
            raise RuntimeError(f"injected fault in the {name} loop ({raised[0]}/{fault.count})")
        await tick()
    return run


# a check real templates make (Llama's, Gemma's), ahead of the bundle's own template
FAULT_TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                  "{{ raise_exception('System role must be the first message') }}{% endif %}{% endfor %}")


def chat_template(template: Optional[str], default: str) -> Optional[str]:
    """The tokenizer's chat template; under ``template`` one that raises (``raise_exception``, as real templates
    do) on a system message that is not the first."""
    if not active_fault("template"):
        return template
    return FAULT_TEMPLATE + (template or default)
