"""opsdk.llm on aarch64 under qemu: the whole decode loop (prefill, decode steps over the KV
cache) built for arm matches the host step by step, in every weight mode.

Needs the cross compiler, qemu-user and the aarch64 sysroot (``opsdk setup arm``); skipped
cleanly when :func:`opsdk.runners.arm_ready` is false.
"""

from __future__ import annotations

import pytest

from opsdk.llm import DecoderConfig, check_on_target, random_weights
from opsdk.runners import arm_ready

pytestmark = [
    pytest.mark.arm,
    pytest.mark.skipif(not arm_ready(), reason="aarch64 emulation not set up (opsdk setup arm)"),
]

CFG = DecoderConfig(vocab=96, width=64, layers=2, heads=2, positions=32)


@pytest.mark.parametrize("mode", ["float32", "int8", "int4"])
def test_decode_loop_on_arm_matches_host(mode):
    res = check_on_target(random_weights(CFG, seed=5), "arm", [3, 1, 4, 1, 5, 9], [2, 6, 5],
                          weights_mode=mode, cache=False)
    assert res["steps"] == 4
    assert "qemu" in res["device"]
    # float32 rounding only (the same bound as the host tests: gamma of the longest chain)
    assert res["target_vs_host"] < 1e-4 and res["target_vs_reference"] < 1e-4
