"""PeerAllReduce argument checks and torch fallback (CPU, gloo, one rank); `rackbed bench` argument handling."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from rackbed.engine.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def test_fallback_sums_and_checks_arguments(group):
    from rackbed.kernels.allreduce import PeerAllReduce

    ar = PeerAllReduce(group, max_bytes=1 << 16, dtype=torch.float32, backend="auto")
    assert ar.backend == "torch" and ar.fallback_reason
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1001, generator=g)
    out = torch.full_like(x, float("nan"))
    y = ar.all_reduce(x, out)
    assert y is out and torch.equal(out, x)  # one rank: the sum is the input, every element written
    assert torch.equal(ar.all_reduce(x), x)
    with pytest.raises(ValueError, match="exceeds max_bytes"):
        ar.all_reduce(torch.zeros(1 << 15))
    with pytest.raises(ValueError, match="does not match"):
        ar.all_reduce(x, torch.empty(5))
    with pytest.raises(ValueError, match="bfloat16 or torch.float32"):
        ar.all_reduce(x.half())
    with pytest.raises(ValueError, match="algo="):
        ar.all_reduce(x, algo="ring")
    with pytest.raises(ValueError, match="contiguous"):
        ar.all_reduce(torch.randn(8, 8).t())
    with pytest.raises(ValueError, match="backend="):
        PeerAllReduce(group, max_bytes=8, backend="nccl")
    ar.close()


def test_cute_backend_refuses_clearly_without_gpu(group):
    from rackbed.kernels.allreduce import PeerAllReduce
    from rackbed.kernels.peer_memory import PeerAccessError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(PeerAccessError, match="unavailable"):
        PeerAllReduce(group, max_bytes=1 << 10, backend="cute")


def test_fabric_handle_needs_explicit_opt_in(group, monkeypatch):
    from rackbed.kernels.peer_memory import PeerAccessError, PeerBuffer

    monkeypatch.delenv("RACKBED_ALLOW_FABRIC", raising=False)
    with pytest.raises(PeerAccessError, match="RACKBED_ALLOW_FABRIC"):
        PeerBuffer(group, 1 << 20, handle="fabric")
    with pytest.raises(ValueError, match="nbytes"):
        PeerBuffer(group, 0)


def test_cli_bench_errors_are_one_line(capsys):
    assert main(["bench", "kernels", "--sizes", "8X"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--sizes entry '8X'" in err
    assert main(["bench", "kernels", "--dtypes", "fp16"]) == 2
    assert "--dtypes entry 'fp16'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "kernels", "--sizes", "8K"]) == 2
        assert "needs 2 GPUs, found 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "nothing"])


def test_suite_registry_rejects_unknown_and_duplicates():
    from rackbed.kernels.bench.suites import BenchConfig, register_suite, run_suites
    from rackbed.topology.errors import UserError

    with pytest.raises(UserError, match="unknown suite 'nope'"):
        run_suites(["nope"], BenchConfig(sizes=(8,)))
    with pytest.raises(ValueError, match="registered twice"):
        register_suite("allreduce", "again", str)(lambda cfg: {})


def test_cli_bench_kernels_default_runs_every_registered_suite(monkeypatch):
    """`rackbed bench kernels` with no --suite runs the MoE suites too (they register when their module loads)."""
    import rackbed.kernels.bench.suites as kb

    seen = {}
    monkeypatch.setattr(kb, "run_suites", lambda names, cfg, out=None: seen.setdefault("names", names))
    assert main(["bench", "kernels", "--sizes", "8K"]) == 0
    assert {"allreduce", "moe_gemm", "moe_a2a", "moe_prefill_gemm"} <= set(seen["names"])
