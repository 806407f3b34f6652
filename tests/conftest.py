"""Shared test settings: hypothesis profiles sized for 2-core CI machines, and Megatron-Core
imported once by the launcher's fork server rather than by every rank that compares with it."""

import os

from hypothesis import HealthCheck, settings

import megart.launcher

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# About fifty launches compare with Megatron-Core (tests/megatron*_workers.py and others), and
# each of their ranks imported megatron.core on its own: some 2 s of CPU a rank, 5 to 7 s of a
# 4-rank launch on 2 cores. The launcher's fork server imports its preload list once, when the
# session's first launch starts it, and forks every rank from it (megart.launcher._PRELOAD); adding
# megatron.core there has each rank start with it already imported. Nothing in megart imports
# megatron (the pytest process itself imports it while collecting), the import starts no
# threads, and a missing megatron-core is skipped by the fork server (it ignores ImportError).
megart.launcher._PRELOAD = [*megart.launcher._PRELOAD, "megatron.core"]
