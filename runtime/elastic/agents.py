"""Node agents: an elastic job whose workers run on several nodes (docs/design.md §9).

One process per node (``hspmd agent --coordinator HOST:PORT --node NAME --token T``) starts that node's
workers and relays what they say; the coordinator (``hspmd train --elastic --agents N``) runs the same
supervisor loop and ``ElasticPolicy`` as a one-host run, with ``AgentWorkers`` as its event source.

Everything travels through the coordinator's TCPStore, which the workers use for their process groups
anyway: each agent pushes its ``Hello``, its beats and its workers' words onto one queue
(``QUEUE_UP``) and pops its orders from its own (``inbox(nonce)``); TCPStore's queues block server-side,
so a relayed word costs one store round trip each way and no polling. The coordinator binds where it is
told (loopback by default). An agent with a wrong job token, for a node the cluster file does not name,
or for a node that already has an agent is refused (and logged); the job goes on.

Losing an agent is losing its node: its beats stop (power, network) or, if only its process died, its
workers exit at once (their control pipes close), and after ``agent_timeout_s`` of silence every worker
of that node is reported ``Lost``, a failure like any other. An agent that says hello later for a node
whose devices are not running brings them back: the policy is told through ``returned_devices``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import os
import pickle
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from runtime.elastic.protocol import (
    Accepted,
    AgentBeat,
    AgentDone,
    FromWorker,
    Hello,
    KillNode,
    KillWorker,
    Refused,
    Spawn,
    StopAgent,
    ToWorker,
)
from runtime.launch.launcher import host_store, prepare
from runtime.launch.messages import Lost, Start
from runtime.launch.options import StepRecord, TrainOptions, WorkerSpec, agent_timeout_s, node_loss_detect_s
from runtime.launch.supervise import LocalWorkers, Policy, Run, RunSummary, WorkerHandle, supervise
from runtime.launch.worker import WorkerLoop
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec.cluster import Cluster

QUEUE_UP = "hspmd/agents/up"
DEFAULT_PORT = 29517
STOP_WAIT_S = 10.0  # how long the coordinator waits for the agents to stop their workers at the end


def inbox(nonce: str) -> str:
    return f"hspmd/agents/to/{nonce}"


def _push(store: Any, key: str, msg: object) -> None:
    store.queue_push(key, pickle.dumps(msg))


def _client(host: str, port: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def parse_address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise HspmdError(f"{what}: expected HOST:PORT such as 127.0.0.1:{DEFAULT_PORT}, got {text!r}")
    return host, int(port)


@dataclass(frozen=True)
class AgentSettings:
    """The coordinator's side of a job with node agents."""

    count: int  # agents to wait for before the job starts
    token: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    join_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"--agents: need at least one agent, got {self.count}")
        if not self.token:
            raise ValueError("--token: the job token must not be empty")


# -- the coordinator's side --------------------------------------------------------------------------------


@dataclass
class _Agent:
    node: str
    nonce: str
    pid: int
    last_seen: float = field(default_factory=time.monotonic)
    lost: bool = False
    done: bool = False


@dataclass(eq=False)
class RemoteLink:
    """A worker on another node, reached through its agent's inbox."""

    source: AgentWorkers
    agent: _Agent
    device: int

    def send(self, msg: object) -> None:
        self.source.order(self.agent, ToWorker(self.device, msg))

    def kill(self) -> None:
        self.source.order(self.agent, KillWorker(self.device))


def _agent_of(w: WorkerHandle) -> _Agent | None:
    return w.link.agent if isinstance(w.link, RemoteLink) else None


class AgentWorkers:
    """The supervisor's event source for a job run by node agents (see the module docstring)."""

    def __init__(self, store: Any, host: str, port: int, token: str, cluster: Cluster, heartbeat_s: float,
                 agent_timeout_s: float, log: Callable[[str], None]) -> None:
        self.store, self.token, self.cluster = store, token, cluster
        self.heartbeat_s, self.agent_timeout_s, self.log = heartbeat_s, agent_timeout_s, log
        self.nodes = {n.name for n in cluster.nodes}
        self.agents: dict[str, _Agent] = {}  # node -> its current agent
        self.workers: dict[int, WorkerHandle] = {}  # device -> its current handle
        self._returned: list[int] = []
        self._events: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()  # orders come from the loop and from RemoteLink alike
        self.started = False
        self._reader: Any = _client(host, port, 10 * 24 * 3600.0)
        self._reading = threading.Thread(target=self._read, daemon=True, name="hspmd-agents-up")
        self._reading.start()

    def _read(self) -> None:
        while True:
            try:
                msg = pickle.loads(self._reader.queue_pop(QUEUE_UP))
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                return
            if msg is None:  # close(): the store is about to go
                return
            self._events.put(msg)

    def close(self) -> None:
        """End the reader before the store goes: a client blocked on a store destroyed under it aborts the
        process (std::terminate) instead of raising."""
        with self._lock:
            _push(self.store, QUEUE_UP, None)
        self._reading.join(10.0)
        self._reader = None
        self.store = None

    def order(self, agent: _Agent, msg: object) -> None:
        if agent.lost:
            return
        with self._lock, contextlib.suppress(Exception):  # a store failure ends the run elsewhere
            _push(self.store, inbox(agent.nonce), msg)

    # -- membership -----------------------------------------------------------------------------------------

    def _hello(self, h: Hello) -> None:
        reason = None
        if not hmac.compare_digest(h.token.encode(), self.token.encode()):
            reason = "wrong job token"
        elif h.node not in self.nodes:
            reason = (f"unknown node {h.node!r} (cluster {self.cluster.name!r} has nodes "
                      f"{', '.join(sorted(self.nodes))})")
        elif h.node in self.agents and not self.agents[h.node].lost:
            reason = f"node {h.node!r} already has an agent (pid {self.agents[h.node].pid})"
        if reason is not None:
            self.log(f"refused an agent for node {h.node!r} (pid {h.pid}): {reason}")
            with self._lock:
                _push(self.store, inbox(h.nonce), Refused(reason))
            return
        returning = h.node in self.agents
        agent = _Agent(h.node, h.nonce, h.pid)
        self.agents[h.node] = agent
        with self._lock:
            _push(self.store, inbox(h.nonce), Accepted(self.heartbeat_s))
        devices = [d.id for d in self.cluster.devices if d.node == h.node]
        self.log(f"agent for node {h.node!r} joined (pid {h.pid}; devices {', '.join(map(str, devices))})")
        if self.started:
            back = [d for d in devices if d not in self.workers or self.workers[d].failed or self.workers[d].finished]
            if back:
                self.log(f"{'returning' if returning else 'new'} node {h.node!r}: device(s) "
                         f"{', '.join(map(str, back))} can join the job")
                self._returned.extend(back)

    def wait_for(self, count: int, needed: set[str], timeout_s: float) -> None:
        """Until ``count`` agents have joined, among them one for every node in ``needed``."""
        end = time.monotonic() + timeout_s
        while len(self.agents) < count or not needed <= set(self.agents):
            left = end - time.monotonic()
            if left <= 0:
                have = ", ".join(sorted(self.agents)) or "none"
                missing = ", ".join(sorted(needed - set(self.agents)))
                raise HspmdError(f"--agents {count}: {len(self.agents)} agent(s) joined within {timeout_s:g} s "
                                 f"(nodes: {have})" + (f"; the plan needs node(s) {missing}" if missing else ""))
            try:
                msg = self._events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if isinstance(msg, Hello):
                self._hello(msg)

    def returned_devices(self) -> list[int]:
        out, self._returned = self._returned, []
        return out

    def kill_node(self, node: str) -> None:
        agent = self.agents.get(node)
        if agent is not None:
            self.order(agent, KillNode())

    # -- the event source -----------------------------------------------------------------------------------

    def start(self, spec: WorkerSpec, loop: WorkerLoop) -> WorkerHandle:
        node = self.cluster.device(spec.device_id).node
        agent = self.agents.get(node)
        if agent is None or agent.lost:
            raise HspmdError(f"device {spec.device_id}: node {node!r} has no agent")
        w = WorkerHandle(spec, RemoteLink(self, agent, spec.device_id))
        w.started = True  # the agent tells it where the store is as it starts it
        self.workers[spec.device_id] = w
        self.order(agent, Spawn(spec, loop))
        return w

    def poll(self, timeout_s: float) -> Iterator[tuple[WorkerHandle, object]]:
        end = time.monotonic() + timeout_s
        wait = timeout_s
        while True:
            try:
                msg = self._events.get(timeout=max(0.0, wait))
            except queue.Empty:
                break
            wait = 0.0  # drain what else has arrived, then return
            yield from self._handle(msg)
            if time.monotonic() > end:
                break
        yield from self._silent_agents()

    def _handle(self, msg: object) -> Iterator[tuple[WorkerHandle, object]]:
        if isinstance(msg, Hello):
            self._hello(msg)
            return
        agent = self.agents.get(getattr(msg, "node", ""))
        if agent is None or agent.nonce != getattr(msg, "nonce", None) or agent.lost:
            return  # a refused or lost agent's late word
        agent.last_seen = time.monotonic()
        if isinstance(msg, FromWorker):
            w = self.workers.get(msg.device)
            if w is not None and _agent_of(w) is agent:
                yield w, msg.msg
        elif isinstance(msg, AgentDone):
            agent.done = True

    def _silent_agents(self) -> Iterator[tuple[WorkerHandle, object]]:
        now = time.monotonic()
        for agent in list(self.agents.values()):
            if agent.lost or agent.done or now - agent.last_seen <= self.agent_timeout_s:
                continue
            agent.lost = True
            how = (f"node {agent.node!r} lost: its agent (pid {agent.pid}) has been silent for "
                   f"{now - agent.last_seen:.1f} s")
            self.log(how)
            for w in list(self.workers.values()):
                if _agent_of(w) is agent and not w.finished and not w.failed:
                    yield w, Lost(how)

    def stop(self) -> None:
        """Tell every agent to stop its workers and exit; wait (briefly) until they say so."""
        live = [a for a in self.agents.values() if not a.lost and not a.done]
        for a in live:
            self.order(a, StopAgent())
        end = time.monotonic() + STOP_WAIT_S
        while any(not a.done and not a.lost for a in live) and time.monotonic() < end:
            try:
                msg = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            for _ in self._handle(msg):
                pass


def launch_agents(options: TrainOptions, policy: Policy, agents: AgentSettings, *,
                  on_step: Callable[[StepRecord], None] | None = None,
                  on_log: Callable[[str], None] | None = None) -> RunSummary:
    """Run ``options`` on the workers of ``agents.count`` node agents under ``policy`` (the coordinator
    of ``hspmd train --elastic --agents N``)."""
    t_start = time.perf_counter()
    log = on_log or (lambda _msg: None)
    prep = prepare(options, policy, one_host=False)
    store = host_store(agents.host, agents.port, options.timeout_s)
    agent_timeout = agent_timeout_s(options.heartbeat_timeout_s)
    source = AgentWorkers(store, agents.host, agents.port, agents.token, prep.ctx.cluster, options.heartbeat_s,
                          agent_timeout, log)
    try:
        needed = {prep.ctx.cluster.device(d).node for d in prep.devices}
        log(f"coordinator listening on {agents.host}:{store.port}: waiting for {agents.count} agent(s) (the plan "
            f"runs on node(s) {', '.join(sorted(needed))})")
        source.wait_for(agents.count, needed, agents.join_timeout_s)
        for d in prep.devices:
            source.start(prep.spec(options, d), policy.worker_loop)
        source.started = True
        log(f"started {len(prep.devices)} workers on {len(needed)} node(s) ({prep.backend}, strategy "
            f"{prep.strategy!r}, devices {', '.join(map(str, prep.devices))})")
        run = Run(options, prep.ctx, prep.strategy, dict(source.workers),
                  RunSummary(prep.strategy, prep.devices, prep.backend), on_step, log, t_start,
                  source=source, make_spec=lambda d: prep.spec(options, d, joining=True),
                  loss_detect_s=node_loss_detect_s(options.heartbeat_s, options.heartbeat_timeout_s))
        policy.begin(run)
        supervise(run, source, policy)
        run.summary.wall_s = time.perf_counter() - t_start
        return run.summary
    finally:
        source.stop()
        source.close()
        del store


# -- the agent's side ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def native_stderr_quiet() -> Iterator[None]:
    """Standard error at the file-descriptor level sent to /dev/null meanwhile: torch's C++ store client logs
    each failed connect attempt with its C++ stack (~40 frames) there, below Python's reach. Agents usually
    start before their coordinator, so those attempts are expected; the caller reports a final failure."""
    import sys

    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:   # no standard error to quiet
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run_agent(coordinator: str, node: str, token: str, *, timeout_s: float = 120.0,
              log: Callable[[str], None] = lambda _m: None) -> None:
    """``hspmd agent``: join the job at ``coordinator`` as node ``node``, run the workers it asks for,
    relay their words, until the job ends. Raises HspmdError when refused or when the coordinator is gone."""
    host, port = parse_address(coordinator, "--coordinator")
    try:
        with native_stderr_quiet():   # the error below says it in one line
            store = _client(host, port, timeout_s)
    except Exception as err:  # noqa: BLE001 - the store's connection errors have no common type
        raise HspmdError(f"--coordinator {coordinator}: cannot reach the coordinator's store: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    nonce = uuid.uuid4().hex
    _push(store, QUEUE_UP, Hello(node, token, nonce, os.getpid()))
    try:
        answer = pickle.loads(store.queue_pop(inbox(nonce)))
    except Exception:  # noqa: BLE001
        raise HspmdError(f"--coordinator {coordinator}: no answer within {timeout_s:g} s") from None
    if isinstance(answer, Refused):
        raise HspmdError(f"--coordinator {coordinator}: node {node!r} refused: {answer.reason}")
    assert isinstance(answer, Accepted)
    log(f"node {node}: joined the job at {coordinator}")
    _AgentLoop(store, host, port, node, nonce, answer.heartbeat_s, log).run()


class _AgentLoop:
    """The agent's threads: its main loop (worker pipes and sentinels -> the coordinator's queue), an
    inbox reader (orders; words for a worker go straight to its control pipe) and its beat."""

    def __init__(self, store: Any, host: str, port: int, node: str, nonce: str, heartbeat_s: float,
                 log: Callable[[str], None]) -> None:
        self.store, self.node, self.nonce, self.log = store, node, nonce, log
        self.local = LocalWorkers()
        self.local.start_store = Start(host, port)
        self.handles: dict[int, WorkerHandle] = {}
        self.orders: queue.Queue[object] = queue.Queue()
        self.gone = threading.Event()  # the coordinator cannot be reached any more
        # Both threads end before the agent returns: a thread blocked in a store call while the interpreter
        # exits aborts the process (std::terminate).
        self.reader = threading.Thread(target=self._read, args=(_client(host, port, 10 * 24 * 3600.0),),
                                       daemon=True, name="hspmd-agent-inbox")
        self.beater = threading.Thread(target=self._beat, args=(_client(host, port, 30.0), heartbeat_s / 2),
                                       daemon=True, name="hspmd-agent-beat")
        self.reader.start()
        self.beater.start()

    def _read(self, store: Any) -> None:
        while True:
            try:
                msg = pickle.loads(store.queue_pop(inbox(self.nonce)))
            except Exception:  # noqa: BLE001 - the coordinator is gone
                self.gone.set()
                return
            if isinstance(msg, ToWorker):
                w = self.handles.get(msg.device)
                if w is not None:
                    w.send(msg.msg)
            elif isinstance(msg, KillNode):
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                self.orders.put(msg)
                if isinstance(msg, StopAgent):
                    return  # the last order

    def _beat(self, store: Any, every_s: float) -> None:
        while not self.gone.is_set():
            try:
                _push(store, QUEUE_UP, AgentBeat(self.node, self.nonce))
            except Exception:  # noqa: BLE001
                self.gone.set()
                return
            time.sleep(every_s)

    def _relay(self, device: int, msg: object) -> None:
        try:
            _push(self.store, QUEUE_UP, FromWorker(self.node, self.nonce, device, msg))
        except Exception:  # noqa: BLE001
            self.gone.set()

    def run(self) -> None:
        try:
            while not self.gone.is_set():
                for w, msg in self.local.poll(0.05):
                    self._relay(w.device, msg)
                while True:
                    try:
                        order = self.orders.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(order, Spawn):
                        spec = order.spec
                        assert isinstance(spec, WorkerSpec)
                        # the worker checks it runs on this agent's node
                        spec = dataclasses.replace(spec, node=self.node)
                        self.handles[spec.device_id] = self.local.start(spec, order.loop)  # type: ignore[arg-type]
                        self.log(f"node {self.node}: started the worker of device {spec.device_id}")
                    elif isinstance(order, KillWorker):
                        w = self.handles.get(order.device)
                        if w is not None:
                            w.hung = True  # stop() kills it without waiting
                            w.kill()
                    elif isinstance(order, StopAgent):
                        self._stop()
                        return
            raise HspmdError(f"node {self.node}: the coordinator went away; stopped this node's workers")
        finally:
            self.local.stop()

    def _stop(self) -> None:
        self.local.stop()
        self.gone.set()  # the beat ends
        self.beater.join(5.0)
        self.reader.join(5.0)
        with contextlib.suppress(Exception):
            _push(self.store, QUEUE_UP, AgentDone(self.node, self.nonce))
        self.log(f"node {self.node}: the job is over")


__all__ = ["AgentSettings", "AgentWorkers", "DEFAULT_PORT", "launch_agents", "parse_address", "run_agent"]
