"""The reward service's trust boundary, against the real supervised service: the job's secret on /score
and /metrics, bounded bodies, and a rule scorer that a short hostile answer cannot wedge (the 20-character
huge-exponent answer of issue 15 held the old service for over 10 minutes, /health dead)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rlslurm.reward.config import RewardConfig
from rlslurm.reward.items import MAX_REASON_CHARS
from rlslurm.reward.supervisor import RewardSupervisor
from rlslurm.secret import bearer

CFG = dict(scorer="rule", concurrency=8, timeout_s=10.0, max_items_per_request=16, max_item_bytes=2048,
           health_interval_s=0.5)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with RewardSupervisor(RewardConfig(**CFG), log_dir=tmp_path_factory.mktemp("reward")) as sup:
        yield sup


def http(sup: RewardSupervisor, token: str | None = "right", timeout_s: float = 30) -> httpx.Client:
    return httpx.Client(base_url=sup.url, timeout=timeout_s, headers=bearer(sup.token if token == "right" else token))


def items(*responses: str, reference: str = "19") -> dict:
    return {"items": [{"id": str(i), "response": r, "reference": reference} for i, r in enumerate(responses)]}


def test_score_and_metrics_need_the_jobs_secret_health_does_not(service):
    for token in (None, "wrong-token"):
        client = http(service, token)
        for method, path, body in (("POST", "/score", items("19")), ("GET", "/metrics", None)):
            r = client.request(method, path, json=body)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.text)
        assert client.get("/health").status_code == 200
    assert http(service).post("/score", json=items("19")).json()["results"][0]["score"] == 1.0
    assert "rlslurm_reward_requests_total" in http(service).get("/metrics").text


def test_an_opened_data_plane_scores_for_anyone_and_metrics_stay_closed(tmp_path):
    with RewardSupervisor(RewardConfig(**CFG, open_data_plane=True), log_dir=tmp_path) as sup:
        anyone = http(sup, None)
        assert anyone.post("/score", json=items("19")).json()["results"][0]["score"] == 1.0
        assert anyone.get("/metrics").status_code == 401


def test_a_huge_exponent_answer_scores_in_bounded_time_and_health_keeps_answering(service):
    hostile = "1e999999999999999999"  # 20 characters: exact arithmetic would build 10**(10**18)
    health_s: list[float] = []
    stop = threading.Event()

    def poll_health():
        with http(service, None, timeout_s=5) as client:
            while not stop.is_set():
                started = time.monotonic()
                assert client.get("/health").status_code == 200
                health_s.append(time.monotonic() - started)
                stop.wait(0.05)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: http(service).post("/score", json=items(hostile, f"#### {hostile}",
                                                                                    "\\boxed{" + hostile + "}")),
                                range(4)))
    wall_s = time.monotonic() - started
    stop.set()
    poller.join(10)
    for answer in answers:
        assert [(r["status"], r["score"]) for r in answer.json()["results"]] == [("scored", 0.0)] * 3
    assert wall_s < 5, wall_s
    assert health_s and max(health_s) < 1.0, health_s
    # The same number as the reference compares as text: equal strings still score.
    same = http(service).post("/score", json=items(hostile, reference=hostile)).json()["results"][0]
    assert same["score"] == 1.0


def test_a_reason_never_echoes_a_long_response(service):
    long_answer = "answer: " + "x" * 1900
    (result,) = http(service).post("/score", json=items(long_answer)).json()["results"]
    assert result["score"] == 0.0 and len(result["reason"]) <= MAX_REASON_CHARS


def test_bodies_are_bounded(service):
    client = http(service)
    too_many = client.post("/score", json=items(*["19"] * 17))
    assert too_many.status_code == 400 and "reward.max_items_per_request = 16" in too_many.text
    big, small = client.post("/score", json=items("9" * 3000, "19")).json()["results"]
    assert big["status"] == "unscored" and "reward.max_item_bytes = 2048" in big["reason"]
    assert small["score"] == 1.0  # the rest of the request is scored
    extra = client.post("/score", json={"items": [{"id": "0", "response": "19", "rubric": "be kind"}]})
    assert extra.status_code == 400 and "rubric" in extra.text
    huge = client.post("/score", json=items(*["1" * 3000] * 20))  # past the whole body's limit: unread
    assert huge.status_code == 413


def test_hostile_json_is_a_400_that_says_why(service):
    client = http(service)
    for hostile, named in ((b'{"items": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "nested deeper"),
                           (b'{"items": [{"id": "0", "response": "19", "reference": ' + b"9" * 20_000 + b"}]}",
                            "digits")):
        r = client.post("/score", content=hostile, headers={"content-type": "application/json"})
        assert r.status_code == 400 and named in r.json()["error"]["message"], r.text[:300]
    assert client.get("/health").status_code == 200
