"""The soak report's arithmetic (the command itself runs against a served application: a benchmark,
not a test), and its reads of the served stats route."""

import pytest

from specserve.burst import summary
from specserve.soak import Outcome, failures_by_phase, markdown, memory_growth, memory_sample, replica_of, windows


def outcome(model, start, end, error="", tokens=32):
    return Outcome(model, 0.0, 32, False, start, end, 200 if not error else 500, tokens if not error else 0, error)


OUTCOMES = [outcome("s", 1, 3), outcome("b", 2, 4), outcome("s", 61, 65), outcome("s", 65, 70, "HTTP 500"),
            outcome("b", 70, 71), outcome("s", 100, 101)]


def test_windows_count_requests_by_start_and_percentiles_of_successes():
    rows = windows(OUTCOMES, 60)
    assert [(w["requests"], w["failures"]) for w in rows] == [(2, 0), (4, 1)]
    assert rows[0]["p50_e2e_s"] == 2.0 and rows[1]["p95_e2e_s"] >= rows[1]["p50_e2e_s"] > 0
    assert rows[0]["p50_ms_per_token"] == 1e3 * 2 / 32


def test_memory_growth_from_the_first_sample_after_warm_up():
    samples = [{"t": 0, "s": 50, "b": 10}, {"t": 60, "s": 100, "b": 10}, {"t": 600, "s": 103, "b": 10}]
    growth = memory_growth(samples, warm_up_s=60)
    assert growth["s"]["after_warm_up_bytes"] == 100 and abs(growth["s"]["change"] - 0.03) < 1e-9
    assert growth["b"]["change"] == 0


def test_memory_growth_of_replicas_that_came_and_went():
    """A replica started during the soak counts from its first sample, one stopped to its last."""
    samples = [{"t": 60, "s #a": 100}, {"t": 120, "s #a": 110, "s #b": 40}, {"t": 180, "s #b": 50}]
    growth = memory_growth(samples, warm_up_s=60)
    assert growth["s #a"] == {"after_warm_up_bytes": 100, "at_end_bytes": 110, "change": pytest.approx(0.1)}
    assert growth["s #b"] == {"after_warm_up_bytes": 40, "at_end_bytes": 50, "change": pytest.approx(0.25)}


def test_failures_split_by_the_engine_outage():
    timeline = {"killed_at_s": 64, "recovered_at_s": 90}
    phases = failures_by_phase(OUTCOMES + [outcome("s", 95, 96, "HTTP 503")], timeline)
    assert phases["total"] == {"s": 2}
    assert phases["during_outage"] == {"s": 1} and phases["after_recovery"] == {"s": 1}
    assert failures_by_phase(OUTCOMES, None)["during_outage"] == {}


def test_markdown_names_every_figure():
    report = {"duration_s": 120, "concurrency": 4, "models": ["s", "b"], "requests": 6, "failures": 1,
              "windows": windows(OUTCOMES, 60), "memory_growth": {"s": {"after_warm_up_bytes": 2**30,
              "at_end_bytes": 2**30, "change": 0.0}}, "unfinished_requests": {"s": 0, "b": 0},
              "draft_tracked_requests": 0, "failures_by_phase": failures_by_phase(OUTCOMES, None), "recovery": None}
    text = markdown(report)
    assert "6 requests, 1 failed" in text and "+0.0%" in text and "draft tracked requests 0" in text


def test_burst_summary_by_status():
    ingress = '{"error": {"message": "Model m is at capacity: every replica is busy and its queue is full."}}'
    proxy = '{"error": {"message": "Request dropped due to backpressure (num_queued_requests=16, max_queued_requests=16)."}}'
    replies = [{"status": 200, "headers": {}, "status_s": 5.0, "end_s": 9.0, "text": "data: [DONE]"},
               {"status": 429, "headers": {"retry-after": "2"}, "status_s": 0.5, "end_s": 0.5, "text": proxy},
               {"status": 429, "headers": {"retry-after": "2"}, "status_s": 1.5, "end_s": 1.5, "text": ingress}]
    result = summary(replies)
    assert result["by_status"] == {200: 1, 429: 2}
    assert result["429"]["status_max_s"] == 1.5 and result["429"]["retry_after"] == ["2"]
    assert result["200"]["end_max_s"] == 9.0
    assert result["429 from the proxy"]["replies"] == 1 and result["429 from the proxy"]["status_max_s"] == 0.5
    assert result["429 from the ingress"]["replies"] == 1 and result["429 from the ingress"]["status_max_s"] == 1.5


def test_replica_process_titles_idle_and_busy():
    prefix = "ray::ServeReplica:specserve:SpecServeLLMServer:"
    assert replica_of(prefix + "specserve-speculative      ", "specserve-speculative")
    assert replica_of(prefix + "specserve-speculative.handle_request_with_rejection()", "specserve-speculative")
    assert replica_of(prefix + "qwen2_5-7b-speculative", "qwen2.5-7b-speculative")
    assert not replica_of(prefix + "specserve-speculative-k2", "specserve-speculative")
    assert not replica_of(prefix + "specserve-baseline", "specserve-speculative")
    assert not replica_of("ray::ServeReplica:specserve:SpecServeIngress", "specserve-speculative")


def test_memory_samples_name_each_replica_and_its_engine_share():
    stats = {"s": {"s#SpecServeLLMServer#r1": {"enabled": True, "replica_memory_bytes": 30, "engine_memory_bytes": 20},
                   "s#SpecServeLLMServer#r2": {"enabled": True, "replica_memory_bytes": 31, "engine_memory_bytes": 21}},
             "b": {"b#SpecServeLLMServer#r3": {"enabled": False, "replica_memory_bytes": 25, "engine_memory_bytes": 15}}}
    assert memory_sample(stats, 12.34) == {"t": 12.3, "s #r1": 30, "s #r1 engine": 20, "s #r2": 31, "s #r2 engine": 21,
                                           "b #r3": 25, "b #r3 engine": 15}


@pytest.mark.slow
def test_the_soak_samples_every_replicas_memory_from_the_served_route(serve_app):
    """`specserve soak`'s reads of the real /v1/specserve/stats: one memory entry per replica of each
    model (one replica each here), its engine's share below it, and the draft's tracked requests summed
    over the speculative model's replicas."""
    from deployment.defaults import BASELINE_MODEL_ID, SPECULATIVE_MODEL_ID
    from specserve.soak import model_stats

    stats = model_stats(serve_app)
    sample = memory_sample(stats, 1.0)
    for model in (SPECULATIVE_MODEL_ID, BASELINE_MODEL_ID):
        (name,) = [k for k in sample if k.startswith(f"{model} #") and not k.endswith(" engine")]
        assert 0 < sample[f"{name} engine"] < sample[name], sample
    assert all(isinstance(s.get("tracked_requests"), list) for s in stats[SPECULATIVE_MODEL_ID].values())


def test_burst_probe_summary_by_source():
    from specserve.burst import probe_summary

    ingress = '{"error": {"message": "Model m is at capacity: every replica is busy and its queue is full."}}'
    proxy = '{"error": {"message": "Request dropped due to backpressure."}}'
    result = probe_summary([{"status": 429, "seconds": 0.01, "text": proxy},
                            {"status": 429, "seconds": 0.3, "text": ingress},
                            {"status": 200, "seconds": 2.0, "text": "{}"}])
    assert result["by_status"] == {429: 2, 200: 1}
    assert result["429 from the proxy"] == {"replies": 1, "p50_s": 0.01, "max_s": 0.01}
    assert result["429 from the ingress"]["max_s"] == 0.3
