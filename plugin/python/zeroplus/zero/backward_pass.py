"""The one owner of "a backward pass is running" in a ZeRO engine.

Participants (the gradient reducer; at stage 3 also the parameter gatherer) are attached in a
fixed order, and that order is the contract: each parameter gets ONE post-accumulate-grad hook,
which calls the participants' on_grad(param) in attach order (the reducer takes the gradient
before the gatherer may release the unit that produced it), and ONE end-of-backward callback is
queued per backward, which calls their end_backward() in attach order (the reducer sends its
last buckets and waits before the gatherer releases what is still gathered).

State: IDLE or RUNNING (with the autograd graph task of the running backward). The first hook
that runs inside a backward (a gradient hook, or the gatherer's pre-backward hook on a module
output) calls enter(): it moves to RUNNING, calls every participant's begin_backward() and
queues the callback. A backward that raises never runs its queued callback, so a RUNNING pass
whose task is not the current one is stale: the next enter() from another backward, a new root
forward, step(), flush or zero_grad closes it with every participant's abandon_backward() (a
participant puts its own state back as it was before the pass) and the engine goes on.

Participant interface: on_grad(param), begin_backward(), end_backward() (may raise: a collective
failed; the other participants still end, then the first error propagates), abandon_backward().
All hooks run on the autograd thread; step/zero_grad on the training thread, never concurrently.
"""

from __future__ import annotations

import enum
import weakref

import torch
from torch.autograd import Variable


class PassState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"


class _GradHook:
    """What each parameter's post-accumulate-grad hook holds: a weak reference to its pass. The
    hook lives in a dict on the parameter, and autograd's AccumulateGrad node holds the parameter
    from C++, where Python's collector cannot follow it: a strong reference closed the cycle
    parameter -> hook -> pass -> participants -> module -> parameter out of the collector's
    sight, and a stage-3 model (with its parameters, masters and optimizer state) was never freed."""

    __slots__ = ("_owner",)

    def __init__(self, owner: "BackwardPass"):
        self._owner = weakref.ref(owner)

    def __call__(self, param) -> None:
        owner = self._owner()
        if owner is not None:
            owner._on_grad(param)


class BackwardPass:
    def __init__(self):
        self.state = PassState.IDLE
        self.task = None  # graph task id of the running backward
        self._participants = []
        self._handlers: dict[int, list] = {}  # id(param) -> on_grad of each participant, in attach order
        self._hooks = []

    @property
    def running(self) -> bool:
        return self.state is PassState.RUNNING

    def attach(self, participant, params) -> None:
        """Adds a participant; its on_grad runs for `params` after earlier participants'."""
        self._participants.append(participant)
        for p in params:
            handlers = self._handlers.get(id(p))
            if handlers is None:
                handlers = self._handlers[id(p)] = []
                self._hooks.append(p.register_post_accumulate_grad_hook(_GradHook(self)))
            handlers.append(participant.on_grad)

    def _on_grad(self, param) -> None:
        self.enter()
        for on_grad in self._handlers[id(param)]:
            on_grad(param)

    def enter(self) -> None:
        """Called by every hook that runs inside a backward; the first one of a backward opens it."""
        task = torch._C._current_graph_task_id()
        if self.state is PassState.RUNNING:
            if task == self.task:
                return
            self.abandon()  # an earlier backward raised: autograd dropped its end callback
        self.state, self.task = PassState.RUNNING, task
        for p in self._participants:
            p.begin_backward()
        Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self.state, self.task = PassState.IDLE, None
        first_error = None
        for p in self._participants:
            try:
                p.end_backward()
            except BaseException as e:  # noqa: BLE001 - the others still end; the first error propagates
                if first_error is None:
                    first_error = e
        if first_error is not None:
            raise first_error

    def abandon(self) -> None:
        self.state, self.task = PassState.IDLE, None
        for p in self._participants:
            p.abandon_backward()

    def close_stale(self) -> None:
        """Outside any backward (a root forward, step, zero_grad): a pass still RUNNING is one
        whose backward raised; close it."""
        if self.state is PassState.RUNNING and torch._C._current_graph_task_id() != self.task:
            self.abandon()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._handlers = {}
