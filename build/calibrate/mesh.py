"""Rollouts and calibration on a Monarch actor mesh: calibration actors, controller, fault handling.

Each ``CalibrationActor`` loads the policy from its path (models never travel in messages), then
works on shards: greedy rollouts for a slice of prompts, or calibration over a slice of batches
returning per-observer (min, max) tensors. The controller splits work, gathers, re-runs the shard of
a process that died on a surviving (or respawned) process, and merges observer state exactly.

Meshes: ``calibration.procs`` processes per host on this host (``this_host().spawn_procs``), or,
with ``calibration.hosts`` set, on a host mesh from a Monarch job: ``calibration.launcher:
process`` runs the hosts as local processes (``monarch.job.ProcessJob``), any other value is the
path of a job a scheduler launcher saved with ``job.dump(path)`` (e.g. ``SlurmJob``).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence

from torch import Tensor

from policy_bundle.build import build_faults
from policy_bundle.build.config.build_config import BuildConfig
from policy_bundle.build.errors import ConfigError, MeshError

from policy_bundle.build.progress import Throttled, log, set_status
from policy_bundle.quantize.calibration import observers



def _import_monarch():
    import monarch.actor

    # Monarch's default hook exits the client when a worker process dies; we recover instead.
    monarch.actor.unhandled_fault_hook = lambda failure: log(f"[mesh] supervision: {failure.report().splitlines()[0]}")
    return monarch.actor


def _host_job(hosts: int, launcher: str):
    """The Monarch job whose hosts run the mesh: ``hosts`` local processes, or a job a launcher saved."""
    from monarch.job import ProcessJob, job_load

    if launcher == "process":
        return ProcessJob({"hosts": hosts})
    if not os.path.isfile(launcher):
        raise ConfigError(f"calibration.launcher: {launcher!r} is neither 'process' nor a file a Monarch job was "
                          "saved to (job.dump(path))")
    try:
        return job_load(launcher)
    except Exception as exc:  # noqa: BLE001 - unpickling a foreign file can raise anything
        raise ConfigError(f"calibration.launcher: {launcher!r} is not a saved Monarch job "
                          f"({type(exc).__name__}: {exc})") from None


@dataclass
class Worker:
    rank: int
    actor: Any  # a one-actor slice of the mesh
    spawn: int  # index into ``CalibrationMesh.spawns``: the proc mesh (and job) it runs on
    host: int = 0  # which of the spawn's proc meshes (one per host of a job)
    alive: bool = True
    pid: int = 0  # its process (on its host), as its setup reported it


@dataclass
class Spawn:
    job: Any = None  # the Monarch job whose hosts run ``procs`` (``calibration.hosts``), else None
    procs: List[Any] = field(default_factory=list)  # Monarch ProcMeshes: this host's, or one per host of ``job``


class CalibrationMesh:
    """The controller's handle on the actors; ``run_shards`` handles timeouts, crashes and re-runs."""

    def __init__(self, cfg: BuildConfig, policy_dir: str):
        self.cfg, self.policy_dir = cfg, policy_dir
        self.spawns: List[Spawn] = []
        self.workers: List[Worker] = []
        self.generation = 0
        self.smoothing = None  # scales every (re)spawned actor applies before calibrating
        self.fault = build_faults.raw_spec()  # handed to every actor at setup

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> float:
        t0 = time.monotonic()
        _import_monarch()
        self.workers = self._spawn_workers(self._spawn_procs(self.cfg.calibration.procs))
        return time.monotonic() - t0

    def _spawn_procs(self, per_host: int) -> Spawn:
        """``per_host`` processes on this host, or on each host of a new Monarch job (``calibration.hosts``)."""
        from monarch.actor import this_host

        c = self.cfg.calibration
        spawn = Spawn(_host_job(c.hosts, c.launcher) if c.hosts else None)
        self.spawns.append(spawn)  # before any host starts: stop() kills the job whatever happens next
        if spawn.job is None:
            spawn.procs = [this_host().spawn_procs(per_host={"procs": per_host})]
        else:  # one proc mesh per host: Monarch 0.7 reports only the first process a proc mesh loses, so
            # with one mesh over every host the calls to a second lost host would never return
            hosts = spawn.job.state(cached_path=None).hosts.flatten("host")
            spawn.procs = [hosts.slice(host=i).spawn_procs(per_host={"procs": per_host}) for i in range(len(hosts))]
        return spawn

    def _spawn_workers(self, spawn: Spawn) -> List[Worker]:
        """One ``CalibrationActor`` per process of ``spawn`` (every host's), set up and smoothed."""
        from policy_bundle.build.calibrate.actor import CalibrationActor

        meshes = [p.spawn(f"calibration{self.generation}", CalibrationActor).flatten("rank") for p in spawn.procs]
        actors = [(h, m.slice(rank=i)) for h, m in enumerate(meshes) for i in range(m.size("rank"))]
        index = len(self.spawns) - 1
        workers = [Worker(len(self.workers) + i, actor, index, h) for i, (h, actor) in enumerate(actors)]
        threads = max(1, (os.cpu_count() or 1) // max(1, self.cfg.calibration.procs))
        recipe = dataclasses.asdict(self.cfg.recipe_config())
        futures = [w.actor.setup.call_one(w.rank, self.policy_dir, self.cfg.policy.max_seq_len, recipe, threads,
                                          self.fault, self.generation) for w in workers]
        for w, f in zip(workers, futures):
            w.pid = int(self._get(f, f"setup of rank {w.rank}")["pid"])
        if self.smoothing is not None:
            for w in workers:
                self._get(w.actor.smooth.call_one(self.smoothing), f"smoothing on rank {w.rank}")
        return workers

    def respawn(self) -> List[Worker]:
        """Fresh actors after every worker died: one process (on each host of a new job with ``hosts``)."""
        self.generation += 1
        workers = self._spawn_workers(self._spawn_procs(1))
        self.workers += workers
        return workers

    def stop(self) -> None:
        for i, spawn in reversed(list(enumerate(self.spawns))):
            lost = any(not w.alive for w in self.workers if w.spawn == i)
            for procs in [] if spawn.job is not None and lost else spawn.procs:
                try:  # (a job that lost a process may have lost its host: a stop would wait for it; kill instead)
                    procs.stop().get(timeout=30)
                except Exception as exc:  # noqa: BLE001 - a dead mesh may refuse a stop; keep going
                    log(f"[mesh] stop: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if spawn.job is not None:
                spawn.job.kill()  # every process of its hosts, orphans included
        self.spawns = []

    # -- work -----------------------------------------------------------------------------------
    def _get(self, fut, what: str):
        try:
            return fut.get(timeout=self.cfg.calibration.timeout_s)
        except TimeoutError:
            raise MeshError(f"{what}: no answer within calibration.timeout_s={self.cfg.calibration.timeout_s}s") from None

    def _lost(self, worker: Worker) -> None:
        """A worker's process died. On a job's host, every worker of that host is taken as lost: a lost host
        takes all its processes with it, and Monarch 0.7 reports only the first one a proc mesh loses."""
        worker.alive = False
        if self.spawns and self.spawns[worker.spawn].job is not None:
            for w in self.workers:
                if w.spawn == worker.spawn and w.host == worker.host:
                    w.alive = False

    def run_shards(self, endpoint: str, shards: Sequence[tuple], sizes: Sequence[int], unit: str,
                   first: int = 0, quiet: bool = False) -> List[Any]:
        """Run ``endpoint(shard_id, *args)`` for every shard, one per live worker at a time, from the ``first`` live
        worker on (a pipeline stage goes to its own actor; a re-run to the next live one). ``quiet``: no line per
        shard done (the caller reports progress its own way)."""
        results: List[Any] = [None] * len(shards)
        pending = list(range(len(shards)))
        t0, done, samples = time.monotonic(), 0, 0
        while pending:
            live = [w for w in self.workers if w.alive] or self.respawn()
            live = live[first % len(live):] + live[:first % len(live)]
            batch = [(s, live[i % len(live)]) for i, s in enumerate(pending[: len(live)])]
            pending = pending[len(live):]
            calls = [(s, w, getattr(w.actor, endpoint).call_one(s, *shards[s])) for s, w in batch]
            for s, w, fut in calls:
                if not w.alive:  # its host was lost while this call was in flight: do not wait for it
                    log(f"[mesh] shard {s} re-run: rank {w.rank} was on a lost host")
                    pending.append(s)
                    continue
                try:
                    results[s] = self._get(fut, f"shard {s} ({endpoint}) on rank {w.rank}")
                except MeshError:
                    raise
                except Exception as exc:  # noqa: BLE001 - sorted into crash vs endpoint error below
                    reason = str(exc).strip().splitlines()
                    if type(exc).__name__ == "SupervisionError":
                        self._lost(w)
                        why = next((ln.strip() for ln in reason if "exited" in ln or "died" in ln), reason[-1] if reason else "")
                        log(f"[mesh] shard {s} re-run: its process (rank {w.rank}) died: {why}")
                        pending.append(s)
                        continue
                    last = next((ln for ln in reversed(reason) if ln.strip()), type(exc).__name__)
                    raise MeshError(f"shard {s} ({endpoint}) failed on rank {w.rank}: {last.strip()}") from None
                done += 1
                samples += sizes[s]
                rate = samples / max(1e-9, time.monotonic() - t0)
                if not quiet:
                    log(f"[mesh] {endpoint}: shards {done}/{len(shards)} done, {samples} {unit}, {rate:.1f} {unit}/s")
        return results


@contextmanager
def calibration_mesh(cfg: BuildConfig, policy_dir) -> Iterator[CalibrationMesh]:
    mesh = CalibrationMesh(cfg, str(policy_dir))
    try:
        startup = mesh.start()
        log(f"[mesh] {len(mesh.workers)} calibration actors up in {startup:.2f}s")
        yield mesh
    finally:
        mesh.stop()


def shard(items: Sequence, n: int) -> List[List]:
    """Contiguous, near-equal shards (at most ``n``, none empty)."""
    n = max(1, min(n, len(items)))
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def mesh_samples(mesh: CalibrationMesh, prompt_ids: Sequence[List[int]], eos: Optional[int]) -> List[List[int]]:
    """Greedy completions, sharded over the actors; the order of results follows ``prompt_ids``."""
    cfg = mesh.cfg
    # Shards of one decode batch (``samples.batch_size``): a progress line per shard keeps long rollouts
    # visible. (vLLM starts one engine per call, so it keeps one shard per actor.)
    b = cfg.samples.batch_size
    n = len(mesh.workers) if cfg.samples.engine == "vllm" else max(len(mesh.workers), -(-len(prompt_ids) // b))
    shards = shard(prompt_ids, n)
    args = [(s, cfg.prompts.max_new_tokens, eos, cfg.samples.engine, b) for s in shards]
    outs = mesh.run_shards("samples", args, [len(s) for s in shards], "seq")
    return [c for part in outs for c in part]


def mesh_calibrate(mesh: CalibrationMesh, batches: Sequence[Tensor]) -> observers.ObserverState:
    """Observer state of every batch, sharded over the actors and merged (exact for min/max)."""
    shards = shard(batches, len(mesh.workers))
    states = mesh.run_shards("calibrate", [(s,) for s in shards], [sum(len(b) for b in s) for s in shards], "samples")
    return observers.merge_observer_states(states)


def mesh_channel_stats(mesh: CalibrationMesh, batches: Sequence[Tensor]):
    """Per-channel max |x| for smoothing, sharded over the actors and merged (exact max)."""
    from policy_bundle.quantize.calibration.smooth import merge_channel_stats

    shards = shard(batches, len(mesh.workers))
    parts = mesh.run_shards("channel_stats", [(s,) for s in shards], [sum(len(b) for b in s) for s in shards],
                            "samples")
    return merge_channel_stats(parts)


def mesh_plan_layers(mesh: CalibrationMesh, shares: Sequence[Sequence[int]], hidden: List[Tensor], recipe
                     ) -> List[tuple]:
    """The w8a8 plan over the actors, share k of the layers on the k-th live actor, which maps only those layers'
    weights. First each share's input: a float forward of the shares before it, one after another (cheap beside a
    plan). Then every share is planned at once, one layer per share per round (``plan_share``), so the actors work
    side by side and the build reports layers done, a rate and an ETA each round. A share whose actor dies is re-run
    from its input on the next live (or a respawned) actor. Every actor drops its whole-model copy (mapped for
    rollouts) first. Returns (plan, statistics kept, output) per share."""
    release_models(mesh)
    inputs = [hidden]
    for k, layers in enumerate(shares[:-1]):
        t0 = time.monotonic()
        (out,) = mesh.run_shards("forward_layers", [(list(layers), inputs[-1])], [len(layers)], "layers", first=k,
                                 quiet=True)
        inputs.append(out)
        log(f"[w8a8] share {k + 2}/{len(shares)}'s input: layers {layers[0]}..{layers[-1]} run in float on the mesh "
            f"in {time.monotonic() - t0:.1f}s")
    key, total, tick = uuid.uuid4().hex, sum(len(s) for s in shares), Throttled()
    results: List[Any] = [None] * len(shares)
    done, t0 = 0, time.monotonic()
    for upto in range(1, max(len(s) for s in shares) + 1):
        active = [k for k, s in enumerate(shares) if len(s) >= upto]
        outs = mesh.run_shards("plan_share", [(f"{key}:{k}", list(shares[k]), inputs[k], recipe, upto) for k in active],
                               [1] * len(active), "layers", first=active[0], quiet=True)
        for k, (_, result) in zip(active, outs):
            if result is not None:
                results[k] = result
        done += len(active)
        set_status(f"layers quantized {done}/{total} over {len(shares)} mesh actors")
        tick(done, total, f"[w8a8] layers quantized over {len(shares)} mesh actors side by side")
    log(f"[w8a8] {total} layers quantized in {len(shares)} shares on the mesh in {time.monotonic() - t0:.1f}s")
    return results


def release_models(mesh: CalibrationMesh) -> None:
    """Every live actor lets go of its whole-model copy (its pages return to the page cache)."""
    for w in [w for w in mesh.workers if w.alive]:
        mesh._get(w.actor.release.call_one(), f"release on rank {w.rank}")


def mesh_apply_smoothing(mesh: CalibrationMesh, scales) -> None:
    """Every live actor re-prepares its policy with the same smoothing scales before calibrating."""
    for w in [w for w in mesh.workers if w.alive]:
        mesh._get(w.actor.smooth.call_one(scales), f"smoothing on rank {w.rank}")
    mesh.smoothing = scales
