"""`MetricSpec.exported` agrees with how Ray really names exported user metrics.

testdata/ray-scrape.txt is a scrape of Ray 2.60's metrics agent recorded by
`python -m tests.support.ray_probe`. Set EMBEDFLEET_TEST_RAY_EXPORT=1 to re-probe a live
(private, one-CPU) Ray instance instead; do that after upgrading Ray, then re-record the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from embedfleet.deployments.common.metrics import MetricSpec
from tests.support import ray_probe

RECORDED = Path(ray_probe.__file__).resolve().parent / "testdata" / "ray-scrape.txt"
# Labels Ray adds to every user metric; rules must aggregate them away (see rules.py).
RAY_LABELS = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId"}
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\} \S+$")


def _samples(text: str) -> dict[str, set[str]]:
    """{sample name: label names} from Prometheus exposition text."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = {kv.split("=", 1)[0] for kv in re.findall(r'\w+="[^"]*"', m["labels"])}
            out.setdefault(m["name"], set()).update(labels)
    return out


def _check(text: str) -> None:
    samples = _samples(text)
    expected = set()
    for name, kind in ray_probe.PROBES:
        exported = MetricSpec(name, kind, "probe", ("model",)).exported  # type: ignore[arg-type]
        expected.update(exported)
        for sample_name in exported:
            assert sample_name in samples, f"{name} ({kind}) is not scraped as {sample_name}"
            assert {"model"} | RAY_LABELS <= samples[sample_name]
    assert set(samples) == expected, "Ray exported names the spec does not predict"


def test_exported_names_match_recorded_ray_scrape():
    _check(RECORDED.read_text())


def test_check_detects_a_wrong_naming_rule():
    text = RECORDED.read_text().replace("ray_embedfleet_probe_inputs_total",
                                        "ray_embedfleet_probe_inputs")
    with pytest.raises(AssertionError):
        _check(text)


@pytest.mark.skipif(os.environ.get("EMBEDFLEET_TEST_RAY_EXPORT") != "1",
                    reason="starts a private Ray instance (~20 s); set EMBEDFLEET_TEST_RAY_EXPORT=1")
def test_exported_names_match_live_ray():
    _check(ray_probe.scrape_probe_metrics())
