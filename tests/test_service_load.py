"""2,000 concurrent requests from several client threads through 2 CPU workers (figures in the output)."""
from __future__ import annotations

import json
import random

import pytest

import service_shared as shared

pytest.importorskip("ray")

from rollout_service import Engine  # noqa: E402

from bench import service_load  # noqa: E402


@pytest.fixture(scope="module")
def service(request):
    shared.cluster()
    yield shared.pool()
    shared.release(request)


@pytest.mark.slow
def test_2000_concurrent_requests(service):
    results = {}
    report = service_load.run_load(service, num_requests=2000, num_threads=8, max_tokens=(4, 8),
                                   results_out=results)
    print("\nservice load:", json.dumps(report))
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["mismatched_prompts"] == 0
    assert report["completed"] == 2000 and report["errors"] == 0
    assert report["worker_executions"] == 2000  # no request ran twice
    # under load, bits are still those of a single in-process engine
    sample = random.Random(0).sample(sorted(results), 40)
    want = Engine(shared.model(), **shared.ENGINE_KWARGS).generate([results[k][0] for k in sample],
                                                                   [results[k][1] for k in sample])
    shared.assert_same([results[k][2][0] for k in sample], want, "under load")
