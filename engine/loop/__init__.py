"""The event loop both executors run on: SimPy's environment with a clock and queue of its own
(:mod:`engine.loop.simenv`) and the run loop that merges arrivals with events (:mod:`engine.loop.runloop`).

Below :mod:`sim` and :mod:`engine.real` (both import it), above :mod:`engine.core` (which it does not need): it is
where ``simpy`` enters, so the scheduling core stays free of it, and the real engine's measured-clock environment
subclasses the simulator's environment without importing the simulator."""
