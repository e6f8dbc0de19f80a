"""One simulated worker: its engine (pdserve's own scheduler), the router's record of it, and
its step loop, each step's cost taken from the profile."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pdserve.engine.prefill_rate import PrefillRate
from pdserve.engine.request_output import RequestOutput
from pdserve.planner.sim_engine import EngineLimits, SimEngine
from pdserve.router.workers import Role, Worker

if TYPE_CHECKING:
    from pdserve.planner.simulator import Simulation


class SimWorker:
    """One worker: its engine, the router's record of it, and its step loop."""

    def __init__(
        self,
        sim: "Simulation",
        role: str,
        name: str,
        degree: int,
        limits: EngineLimits,
        borrow: int | None = None,
        yields: bool = False,
    ) -> None:
        self.sim, self.role, self.own, self.degree = sim, role, degree, degree
        self.borrowed = borrow if borrow is not None and borrow > degree else degree  # engine/thread_budget.py
        self.yields = yields  # its threads sleep while they wait: it runs on the cores others leave
        self.engine = SimEngine(limits)
        self.engine.connector.wake = lambda: sim._wake(self)  # a transfer's outcome is waiting in its inbox
        # An acknowledged prefill answers the router at once, not at the engine's next step.
        self.engine.connector.deliver_early = lambda out: self._hand_out([out])
        self.record = Worker(name, Role.PREFILL if role == "prefill" else Role.DECODE, channel=None)
        self.handlers: dict[str, Callable[[RequestOutput], None]] = {}
        self.prefill_rate = PrefillRate()  # as LLMEngine estimates it
        self.schedule = None  # the step in progress
        self.shape = None  # its shape (for its cost at fewer threads)
        self.work_ms = 0.0  # what is left of it, in ms at full speed
        self.speed = 1.0  # of the step in progress, while the busy set stays as it is
        self.version = 0  # bumped whenever its end is rescheduled (stale end events are dropped)
        self.charged_at = 0.0  # when work_ms was last brought up to date
        self.aborts: list[str] = []  # requests the router cancelled during a step: dropped after it

    @property
    def busy(self) -> bool:
        return self.schedule is not None

    def kick(self) -> None:
        """The engine thread's loop: an idle worker with requests begins a step. The outputs it
        has at once (reservations, acknowledged handoffs) go out now; the forward pass, if
        anything is scheduled, ends after its cost."""
        if self.busy or not self.engine.has_unfinished():
            return
        outputs, schedule = self.engine.begin_step()
        self._hand_out(outputs)
        if schedule.empty:
            return  # waiting for blocks or for K/V: a finish, a release or an outcome kicks it again
        shape = self.engine.shape(schedule)
        overheads = self.sim.profile.overheads
        # A decode-only step with nothing waiting for remote KV borrows the prefill pool's cores.
        borrow = not schedule.prefills and not self.engine.scheduler.waiting_for_kv
        self.degree = self.borrowed if borrow else self.own
        cost = self.sim.profile.step_cost(self.degree)
        self.shape = shape
        self.work_ms = cost.ms(shape) + overheads.step_ms + overheads.seq_ms * len(schedule.chunks)
        self.prefill_rate.observe(shape.prefill_tokens, self.work_ms / 1e3)
        self.schedule = schedule
        self.sim.reshare(started=self)

    def step_done(self, version: int) -> None:
        if version != self.version:
            return  # rescheduled since
        schedule, self.schedule = self.schedule, None
        self.sim.reshare()
        self._hand_out(self.engine.finish_step(schedule))
        for request_id in self.aborts:
            self.engine.abort(request_id)
        self.aborts.clear()
        self.kick()

    def abort(self, request_id: str) -> None:
        """As the engine thread takes an abort: between steps, never inside one."""
        if self.busy:
            self.aborts.append(request_id)
        else:
            self.engine.abort(request_id)

    def _hand_out(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            handler = self.handlers.get(out.request_id)
            if handler is not None:
                handler(out)

    def publish_stats(self) -> None:
        self.record.update_stats(self.engine.stats(self.record.address, self.role, self.prefill_rate.tokens_per_s))
