"""The CLI keeps the terminal clean: no Ray NPU-probe traceback on a machine without CANN."""

from __future__ import annotations

import logging

from embedfleet.cluster import cli, local

PROBE = """2026-11-30 14:04:12,123\tERROR npu.py:82 -- Failed to detect NPU type.
Traceback (most recent call last):
  File "/x/ray/_private/accelerators/npu.py", line 78, in get_current_node_accelerator_type
    import acl
ModuleNotFoundError: No module named 'acl'
"""


def test_ray_start_output_loses_only_the_npu_probe_traceback():
    real = "2026-11-30 14:04:13,000\tWARNING services.py:2100 -- shared memory is small\n"
    assert local.without_npu_probe_noise(PROBE + real + PROBE) == real
    assert local.without_npu_probe_noise(real) == real
    # a traceback that is not the probe's (another error after the same first line) stays whole
    other = PROBE.replace("ModuleNotFoundError: No module named 'acl'", "RuntimeError: boom")
    assert local.without_npu_probe_noise(other) == other


def test_the_cli_filters_the_probe_record_and_serve_info(caplog):
    cli.quiet_ray_logs()
    npu = logging.getLogger("ray._private.accelerators.npu")
    with caplog.at_level(logging.INFO):
        npu.error("Failed to detect NPU type.")
        npu.error("something else went wrong")
        logging.getLogger("ray.serve").info("Started <SharedRouterLongPollClient>")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["something else went wrong"], messages
