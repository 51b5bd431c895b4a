"""Shared test settings and fixtures: hypothesis profiles (``ci`` is derandomized so CI failures reproduce),
matplotlib Agg, Triton kernels under Triton's interpreter (on the CPU), and the tiny Qwen3-MoE checkpoint the
real-engine tests share."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
# kernels/paged_attention.py is checked on the CPU by Triton's interpreter; the switch must be on before triton is
# first imported (triton.language builds its own helpers at import time)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def tiny_qwen3moe_ckpt(tmp_path_factory):
    """``(config, model, folder)`` of the tiny Qwen3-MoE (``tiny_qwen3moe.tiny_checkpoint``), built once for the
    session: the real-engine tests read the model and the folder and never write to either."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_qwen3moe import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3moe"))
