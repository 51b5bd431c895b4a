"""Shared test settings: hypothesis profiles (``ci`` is derandomized so CI failures reproduce), matplotlib Agg,
Triton kernels under Triton's interpreter (on the CPU)."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
# kernels/paged_attention.py is checked on the CPU by Triton's interpreter; the switch must be on before triton is
# first imported (triton.language builds its own helpers at import time)
os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
