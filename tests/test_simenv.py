"""``engine.loop.simenv.SimEnv`` (SimPy's environment with a clock and queue of its own) is tied to the SimPy
versions it is tested with: this fails on another version, the pin in pyproject.toml names the same versions, and
random event programs (processes, timeouts, events succeeded by other processes, interrupts, conditions, failures)
run exactly as in ``simpy.Environment``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.loop.simenv import TESTED_SIMPY, SimEnv

ROOT = Path(__file__).resolve().parents[1]


def test_simpy_is_a_tested_version():
    assert simpy.__version__ in TESTED_SIMPY, (
        f"simpy {simpy.__version__} is not one engine/loop/simenv.py is tested with ({', '.join(TESTED_SIMPY)}): "
        "check simpy.Environment's now/schedule/peek/step against SimEnv's and extend TESTED_SIMPY and the pin")


def test_pyproject_pins_the_tested_versions():
    text = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"simpy([^"]*)"', text).group(1)
    lo, hi = min(TESTED_SIMPY), max(TESTED_SIMPY)
    assert pin == f">={lo},<={hi}", pin


def _program(env, ops, trace: list) -> None:
    """Processes driven by ``ops``: each waits (timeouts, possibly zero), waits for a shared event, succeeds it,
    interrupts a neighbour, waits for all/any of two timeouts, fails an event it then defuses, or fails itself;
    every step is traced with the time."""
    shared = [env.event() for _ in range(3)]
    procs = []

    def proc(i, steps):
        for kind, x in steps:
            try:
                if kind == "wait":
                    v = yield env.timeout(x / 4, value=x)
                elif kind == "event":
                    v = yield shared[x % 3]
                elif kind == "succeed":
                    ev = shared[x % 3]
                    if not ev.triggered:
                        ev.succeed(i)
                    v = None
                elif kind == "interrupt":
                    p = procs[(i + 1 + x) % len(procs)]
                    if p.is_alive and p is not env.active_process:
                        p.interrupt(i)
                    v = None
                elif kind == "all":
                    v = sorted((yield env.all_of([env.timeout(x / 8, 1), env.timeout(x / 3, 2)])).values())
                elif kind == "any":
                    v = sorted((yield env.any_of([env.timeout(x / 8, 1), env.timeout(x / 3, 2)])).values())
                elif kind == "boom" and x == 5:
                    raise RuntimeError(f"process {i} fails")  # nobody waits on it: the step raises
                else:  # fail: a failed event whose failure a callback defuses
                    ev = env.event()
                    ev.callbacks.append(lambda e: setattr(e, "defused", True))
                    ev.fail(ValueError(x))
                    v = None
                trace.append((env.now, i, kind, v))
            except simpy.Interrupt as intr:
                trace.append((env.now, i, "interrupted", intr.cause))
        return i

    for i, steps in enumerate(ops):
        procs.append(env.process(proc(i, steps)))


_op = st.tuples(st.sampled_from(["wait", "wait", "event", "succeed", "interrupt", "all", "any", "fail", "boom"]),
                st.integers(0, 5))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_op, max_size=8), min_size=1, max_size=5), st.floats(0, 5))
def test_event_programs_run_as_in_simpy(ops, until):
    runs = []
    for env in (simpy.Environment(), SimEnv()):
        trace: list = []
        _program(env, ops, trace)
        try:
            while env.peek() <= until:
                env.step()
        except RuntimeError as exc:
            trace.append(("crash", str(exc)))
        trace.append(("end", env.now, env.peek()))
        runs.append(trace)
    assert runs[0] == runs[1]


def test_ready_event_trigger_and_advance():
    env = SimEnv()
    got = []
    ev = env.event()

    def waiter():
        got.append((yield ev))
        got.append(env.now)

    env.process(waiter())
    env.advance(1.0)
    assert env.now == 1.0
    env.advance(0.5)  # never backwards
    assert env.now == 1.0
    env.trigger(ev, "done", 2.5)
    while env.peek() < float("inf"):
        env.step()
    assert got == ["done", 3.5]
    r = env.ready_event()
    assert r.ok and r.value is None and all(e[3] is not r for e in env.queue)
    with pytest.raises(simpy.core.EmptySchedule):
        env.step()


_SIMPY_PRIVATE = {"_now", "_queue", "_eid", "_ok", "_value", "_defused"}


def _private_simpy_uses(path: Path, imports: bool = False) -> list[str]:
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in _SIMPY_PRIVATE:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
        elif imports and isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sim."):
            out.extend(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}"
                       for a in node.names if a.name.startswith("_"))
    return out


@pytest.mark.slow
def test_simpy_internals_stay_in_simenv():
    """SimPy's private attributes are used in engine/loop/simenv.py only, and the real engine imports no private
    name of the simulator."""
    simenv = ROOT / "engine" / "loop" / "simenv.py"
    bad = [x for p in (ROOT / "sim").rglob("*.py") for x in _private_simpy_uses(p)]
    bad += [x for p in (ROOT / "engine").rglob("*.py") if p != simenv for x in _private_simpy_uses(p, imports=True)]
    assert not bad, "\n".join(bad)
    assert _private_simpy_uses(simenv)  # the scanner sees them where they are
