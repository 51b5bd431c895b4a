"""Multi-node real runs under torchrun: one process per GPU of the topology, global rank = topology GPU id.

    # on each of the 18 compute trays of a GB200 NVL72 (4 GPUs each), node rank 0..17:
    torchrun --nnodes=18 --nproc-per-node=4 --node-rank=$NODE_RANK \\
             --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 --rdzv-id=rackbed \\
             -m rackbed.engine.cli.torchrun scenarios/nvl72-default.yaml --out rackbed-out/nvl72-real

    # SLURM: srun --nodes=18 --ntasks-per-node=1 torchrun ... (same line, NODE_RANK=$SLURM_NODEID)

Every process builds the scenario and the same rank table (``engine.real.driver.rank_specs``), creates every
group's process group in the same order, and serves plan commands for its GPU (ranks whose GPU the deployment
does not use only wait for the stop). Global rank 0 also runs the driver — the simulator's loop
(``sim.driver.simulate``, passed to ``engine.real.driver.run_real``) with the real executor — in its main thread
while its own rank serves in a second thread, and writes the simulator's output files plus ``real.json``.
Commands, replies and liveness cross hosts through rank 0's key-value store (``engine.real.kvstore``, used
by ``engine.real.torchrun``: ``agree_run``, ``StoreQueue``, ``heartbeat``, ``store_pool``) that listens on
``$RACKBED_STORE_BIND`` (default ``MASTER_ADDR``) only and serves only clients holding the run's token
(``$RACKBED_RUN_TOKEN`` on every host, else a random one rank 0 broadcasts over the process group); its
messages are sealed with the token and bound to the run's nonce (``engine.real.wire`` says what that
protects). ``real.json`` counts what was refused (``store_refusals``: by rank 0's process, and by each rank as
of its last heartbeat). Collectives and KV transfers use the process groups (NCCL over NVLink inside the
NVLink domain and InfiniBand beyond it; gloo on CPU for the tests, where several torchrun "nodes" on one
machine stand in for trays).

The entry lives here, above ``engine/real``, because it builds the scenario (``sim.scenario``) and writes the
outputs (``sim.outputs``) with the simulator's modules, which ``engine/real`` does not import.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from datetime import timedelta


def _shared_token(rank: int, device: str) -> bytes:
    """The run's message token: ``$RACKBED_RUN_TOKEN`` when set (the same on every host), else 64 random hex
    characters from rank 0, broadcast over the default process group (never through the store)."""
    import secrets

    import torch
    import torch.distributed as dist

    from rackbed.engine.real.wire import TOKEN_ENV, run_token

    if os.environ.get(TOKEN_ENV):
        return run_token()
    t = torch.zeros(64, dtype=torch.uint8, device=device)
    if rank == 0:
        t.copy_(torch.tensor(list(secrets.token_hex(32).encode()), dtype=torch.uint8))
    dist.broadcast(t, 0)
    return bytes(t.cpu().tolist())


#: the output folder without --out (a fresh NAME-2, NAME-3 … beside it when taken: topology.outputs)
DEFAULT_OUT = "rackbed-out/real-torchrun"


def prepare_out(out: str | None, force: bool):
    """Rank 0's output folder, claimed under the output rule (``topology.outputs.prepare_dir``) before the
    run: ``--out`` missing or empty (or ``--force``), never a link nor shipped data; without ``--out`` a fresh
    folder beside :data:`DEFAULT_OUT`. A broken rule prints one line and exits with status 2."""
    from rackbed.topology.outputs import entry_dir

    return entry_dir(out or DEFAULT_OUT, force=force, default=out is None)


def main(argv=None) -> int:
    """One torchrun process: serve this rank's GPU; on global rank 0 also drive the run and write its outputs."""
    import torch
    import torch.distributed as dist

    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import rank_specs, real_model_config, run_real
    from rackbed.engine.real.rank_setup import kv_rings
    from rackbed.engine.real.torchrun import (
        BIND_ENV,
        agree_run,
        command_queue,
        heartbeat,
        listen_socket,
        open_store,
        reply_queue,
        store_pool,
    )
    from rackbed.engine.real.worker import Rank, make_groups
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, load_scenario

    ap = argparse.ArgumentParser(description="a rackbed real run under torchrun (see the module docstring)")
    ap.add_argument("scenario")
    ap.add_argument("--out", default=None,
                    help=f"output folder (default {DEFAULT_OUT}, or a fresh one beside it)")
    ap.add_argument("--force", action="store_true", help="write into an existing, non-empty --out folder")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = prepare_out(a.out, a.force) if rank == 0 else None  # before the run, not after it
    local = int(os.environ.get("LOCAL_RANK", "0"))
    sc = load_scenario(a.scenario)
    rs = sc.real
    device = a.device or rs.device
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=120))
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
    token = _shared_token(rank, "cuda" if use_cuda else "cpu")
    listen = listen_socket(os.environ.get(BIND_ENV) or host, port) if rank == 0 else None
    store = open_store(host, port, token, listen=listen)
    run_id = agree_run(store, rank, world, token)
    stop_hb = threading.Event()
    threading.Thread(target=heartbeat, args=(host, port, rank, token, run_id, stop_hb), daemon=True).start()
    b = build(sc)
    if b.topology.n_gpus != world:
        raise SystemExit(f"rackbed: error: {a.scenario}: torchrun started {world} processes but topology "
                         f"{sc.topology} has {b.topology.n_gpus} GPUs (one process per GPU)")
    cfg = real_model_config(b, weights=rs.weights)
    reqs = generate(sc.workload, sc.seed)
    specs = rank_specs(b, cfg, {g: g for g in range(world)}, world, use_cuda=use_cuda, dtype=rs.dtype,
                       seed=rs.weights_seed, weights=rs.weights, prefill_pages=rs.prefill_pages,
                       decode_pages=rs.decode_pages, backend="nccl" if use_cuda else "gloo",
                       local_device=lambda g: f"cuda:{local}" if use_cuda else "cpu", requests=reqs,
                       mtp_agree=rs.mtp_agree)
    any_spec = next(iter(specs.values()))
    # every process creates every group, then the KV group, in the same order
    groups, kv_group = make_groups(any_spec.all_groups, world)

    def serve() -> None:
        cmd_q = command_queue(open_store(host, port, token), rank, token, run_id)
        res_q = reply_queue(open_store(host, port, token), world, token, run_id)
        if rank in specs:
            worker = Rank(specs[rank], groups[specs[rank].group_id], kv_group)
            res_q.put((None, rank, "ready", None))
            worker.serve(cmd_q, res_q)
        else:
            while cmd_q.get()[0] != "stop":
                pass

    rc = 0
    if rank != 0:
        serve()
    else:
        t = threading.Thread(target=serve, daemon=True)
        t.start()
        from rackbed.sim.outputs import write_all
        from rackbed.topology.outputs import write_text

        pool = store_pool(store, world, token, run_id)
        try:
            res, run = run_real(b, reqs, simulate=simulate, device=device, dtype=rs.dtype, weights=rs.weights,
                                seed=rs.weights_seed, prefill_pages=rs.prefill_pages, decode_pages=rs.decode_pages,
                                pool=pool, profile_plans=rs.profile_plans, mtp_agree=rs.mtp_agree)
        finally:
            pool.stop()
        t.join(timeout=60)
        import json

        from rackbed.engine.core.deployment import kv_capacities
        from rackbed.engine.real.driver import bad_endings, replay

        write_all(res, out)
        same = res.log.decisions() == replay(b, reqs, run.records, simulate=simulate, seed=sc.seed,
                                                deaths=run.deaths).log.decisions()
        write_text(out / "real.json", json.dumps({
            "scenario": str(a.scenario), "world": world, "replay_identical_decisions": same,
            "kv_capacity": kv_capacities(b.deployment),
            "kv_rings": kv_rings(b, cfg, rs.prefill_pages, rs.decode_pages, reqs),
            "deaths": [{"t_s": t, "rank": r, "gpu": g} for t, r, g in run.deaths],
            "generated_tokens": {str(k): v for k, v in sorted(run.generated.items())},
            "prompt_ids": {str(k): v for k, v in sorted(run.prompt_ids.items())},
            "plans": [{"worker": w, "kind": k, "key": key, "measured_s": m, "worker_s": ws,
                       **({"accepted": acc[0]} if acc else {})} for w, k, key, m, ws, *acc in run.records],
            "metrics": res.metrics,
            "store_refusals": pool.refusals(),
            **({"term_profile": run.term_profile, "term_profile_error": run.term_profile_error}
               if rs.profile_plans else {})}, indent=1, default=str))
        m = res.metrics["requests"]
        print(f"real run over {world} ranks: {m['done']}/{m['total']} done, {m['rejected']} rejected; "
              f"replay identical: {same}; wrote {out}")
        bad = bad_endings(res.metrics)
        if bad:
            print("rackbed: error: real run: requests ended without an acceptable reason: "
                  + ", ".join(f"{n} {why}" for why, n in sorted(bad.items())), file=sys.stderr)
        rc = 0 if same and not bad else 1
    stop_hb.set()
    dist.barrier()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
