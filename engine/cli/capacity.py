"""``rackbed capacity``: the best deployment on a fixed GPU budget under SLOs, by a request-rate sweep of searches.

    rackbed capacity --out results/capacity --tag before       # scenarios/sweeps/capacity-qwen235-{gb200,h200}.yaml
    rackbed capacity scenarios/sweeps/capacity-qwen235-h200.yaml --out DIR --jobs 2

Writes OUT/<tag>.json and OUT/<tag>.md (see ``sim.capacity``); the searches go to WORK (resumable).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from rackbed.topology.outputs import add_force, prepare_dir, prepare_file, safe_name


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capacity",
        help="best deployment per topology and format on a GPU budget under SLOs (a rate sweep of searches)",
        description="For each (topology, weight format) of each capacity spec, run a search at every request rate "
        "of the spec, keep the simulated points that meet the SLOs within the GPU budget, choose the one at the "
        "highest rate, and compare topologies at equal tokens/s per user. Writes OUT/<tag>.json and OUT/<tag>.md.",
    )
    p.add_argument("specs", nargs="*", help="capacity spec YAMLs (kind: capacity) or names under scenarios/sweeps/ "
                   "(default: capacity-qwen235-gb200 capacity-qwen235-h200)")
    p.add_argument("--out", type=Path, required=True, help="folder for <tag>.json and <tag>.md")
    p.add_argument("--tag", default="capacity", help="file name stem of the outputs (default capacity)")
    add_force(p, "replace existing OUT/<tag>.json and OUT/<tag>.md")
    p.add_argument("--work", type=Path, default=None,
                   help="folder for the searches (default rackbed-out/capacity-<tag>-<git commit>)")
    p.add_argument("--jobs", "-j", type=int, default=1, help="worker processes per search (default 1)")
    p.add_argument("--progress", action="store_true", help="a progress bar per search")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import sys

    from rackbed.sim import capacity as cap

    if safe_name(args.tag) != args.tag:
        raise ValueError(f"--tag: expected a plain file name stem (letters, digits, '._+-'), got {args.tag!r}")
    # before hours of searches, not after. The folder collects one pair of files per tag (so it may hold
    # others): claimed, never a link nor shipped data; the two files need --force to be replaced
    prepare_dir(args.out, own=lambda q: True)
    for suffix in (".json", ".md"):
        prepare_file(args.out / f"{args.tag}{suffix}", force=args.force)
    names = args.specs or list(cap.DEFAULT_SPECS)
    specs = [cap.load_capacity(s) for s in names]
    command = shlex.join(["rackbed", "capacity", *args.specs, "--out", str(args.out), "--tag", args.tag,
                          *(["--work", str(args.work)] if args.work else []), "--jobs", str(args.jobs)])
    meta = cap.provenance(command)
    work = args.work or Path("rackbed-out") / f"capacity-{args.tag}-{(meta['git_commit'] or 'nogit')[:12]}"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # the searches' working folder resumes whatever it holds (searches of the same specs); one run at a time
    prepare_dir(work, own=lambda q: True, flag="--work")
    log(f"searches in {work}")
    run = cap.run_capacity(specs, work, jobs=args.jobs, progress=args.progress, command=command, log=log)
    files = cap.write(args.out, args.tag, run)
    print(cap.markdown(run.as_dict()))
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0
