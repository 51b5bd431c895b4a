"""Measurements of the real engine, run with ``python -m`` on GPUs: the decode step against its HBM roofline
(:mod:`engine.bench.decode`), the peer-memory dispatch/combine in the engine's MoE (:mod:`engine.bench.peer_a2a`)
and the peer-memory TP all-reduce (:mod:`engine.bench.tp_allreduce`), each against the path it replaces.

A layer of its own at the top, beside ``engine/cli``: the tools drive ``engine/real`` on model shapes the simulator
defines (``sim.scenario.truncate_model``), so they may import both, and nothing imports them."""
