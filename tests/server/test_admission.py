"""Admission control without a server: token buckets on a fake clock, queue caps, and the
`pjinfer serve` flags and TOML keys that configure them."""

from __future__ import annotations

import pytest

from pjinfer import cli
from pjinfer.run_config import RunConfigError, parse_run_config
from pjinfer.server.admission import Admission, AdmissionLimits, TokenBucket, retry_after_header
from pjinfer.server.protocol import APIError


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_allows_a_burst_then_refills_at_its_rate():
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, capacity=3.0, clock=clock)
    for _ in range(3):  # the burst
        assert bucket.wait_time(1) == 0
        bucket.take(1)
    assert bucket.wait_time(1) == pytest.approx(0.5)  # one request at 2/s
    clock.now += 0.5
    assert bucket.wait_time(1) == 0
    clock.now += 100  # refilling stops at the capacity
    assert bucket.level <= 3.0 and bucket.wait_time(3) == 0 and bucket.wait_time(4) == 0


def test_bucket_token_cost_and_debt():
    """A cost larger than the bucket goes through when it is full and leaves a debt that
    later requests wait out, so the long-run rate holds."""
    clock = FakeClock()
    bucket = TokenBucket(rate=100.0, capacity=100.0, clock=clock)
    bucket.take(250)
    assert bucket.wait_time(10) == pytest.approx(1.6)  # 150 owed + 10 wanted, at 100/s
    clock.now += 1.6
    assert bucket.wait_time(10) == pytest.approx(0.0, abs=1e-9)


def test_retry_after_rounds_up_to_whole_seconds():
    assert [retry_after_header(s) for s in (0.01, 0.5, 1.0, 1.2, 7.9)] == \
        ["1", "1", "1", "2", "8"]


def test_keys_have_their_own_buckets():
    clock = FakeClock()
    admission = Admission(AdmissionLimits(rate_limit_requests=1, rate_limit_burst=2), clock)
    admission.admit("a", 5, 5).release()
    admission.admit("a", 5, 5).release()
    with pytest.raises(APIError) as refused:
        admission.admit("a", 5, 5)
    assert refused.value.status == 429 and refused.value.retry_after == pytest.approx(1.0)
    assert "--rate-limit-requests" in refused.value.message
    admission.admit("b", 5, 5).release()  # another key is not slowed by "a"
    clock.now += 1.0
    admission.admit("a", 5, 5).release()


def test_token_rate_counts_prompt_and_max_tokens():
    clock = FakeClock()
    admission = Admission(AdmissionLimits(rate_limit_tokens=100), clock)
    admission.admit(None, 30, 50).release()
    with pytest.raises(APIError) as refused:
        admission.admit(None, 30, 50)  # 20 left, 80 wanted: 0.6 s at 100 tokens/s
    assert refused.value.status == 429 and refused.value.retry_after == pytest.approx(0.6)
    assert refused.value.type == "tokens"


def test_queue_caps_refuse_with_503_until_a_request_finishes():
    admission = Admission(AdmissionLimits(max_num_queued_requests=2,
                                          max_num_queued_tokens=100))
    first, second = admission.admit(None, 10, 1), admission.admit(None, 10, 1)
    with pytest.raises(APIError) as full:
        admission.admit(None, 10, 1)
    assert full.value.status == 503 and "--max-num-queued-requests" in full.value.message
    first.release()
    first.release()  # a ticket is given back once
    assert admission.queued_requests == 1
    with pytest.raises(APIError) as full:
        admission.admit(None, 95, 1)
    assert full.value.status == 503 and "--max-num-queued-tokens" in full.value.message
    second.release()
    with admission.admit(None, 500, 1):  # alone, even a prompt over the cap gets in
        assert admission.queued_tokens == 500
    assert (admission.queued_requests, admission.queued_tokens) == (0, 0)


def test_a_refused_request_costs_nothing():
    clock = FakeClock()
    admission = Admission(AdmissionLimits(rate_limit_requests=10, max_num_queued_requests=1),
                          clock)
    held = admission.admit("a", 1, 1)
    for _ in range(20):  # refused by the queue cap: the rate bucket is not drawn on
        with pytest.raises(APIError):
            admission.admit("a", 1, 1)
    held.release()
    admission.admit("a", 1, 1).release()


@pytest.mark.parametrize(("flags", "words"), [
    (["--rate-limit-requests", "-1"], "--rate-limit-requests must be a number > 0"),
    (["--rate-limit-tokens", "0"], "--rate-limit-tokens"),
    (["--rate-limit-requests", "5", "--rate-limit-burst", "0.5"], "--rate-limit-burst"),
    (["--rate-limit-burst", "3"], "--rate-limit-burst needs --rate-limit-requests"),
    (["--max-num-queued-requests", "0"], "--max-num-queued-requests"),
    (["--max-num-queued-tokens", "-5"], "--max-num-queued-tokens"),
    (["--api-key-file", "/nonexistent/keys.txt"], "--api-key-file"),
])
def test_bad_admission_flags_name_the_flag(capsys, flags, words):
    assert cli.main(["serve", *flags]) == 2
    assert words in capsys.readouterr().err


def test_keys_and_limits_reach_the_server(monkeypatch, tmp_path):
    """--api-key repeated plus --api-key-file: every key is accepted; limits are passed on."""
    seen = {}
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nk2\n\nk3\n")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setattr("pjinfer.engine.async_engine.AsyncEngine", lambda config: "engine")
    monkeypatch.setattr("pjinfer.server.serve.serve",
                        lambda engine, options, **kw: seen.update(options=options))
    assert cli.main(["serve", "--api-key", "k0", "--api-key", "k1", "--api-key-file",
                     str(keys), "--rate-limit-requests", "5", "--rate-limit-tokens", "1000",
                     "--max-num-queued-requests", "64"]) == 0
    options = seen["options"]
    assert options.keys == ("k0", "k1", "k2", "k3")
    assert options.admission == AdmissionLimits(rate_limit_requests=5, rate_limit_tokens=1000,
                                                max_num_queued_requests=64)
    assert options.admission.burst == 5


def test_toml_server_keys():
    config = parse_run_config({"server": {"api_key": ["a", "b"], "rate_limit_requests": 2,
                                          "rate_limit_burst": 4, "max_num_queued_tokens": 9}})
    args = config.server_args()
    assert args["api_key"] == ["a", "b"] and args["rate_limit_burst"] == 4
    with pytest.raises(RunConfigError, match="rate_limit_tokens must be a number"):
        parse_run_config({"server": {"rate_limit_tokens": "fast"}})
    with pytest.raises(RunConfigError, match="api_key must be a string or an array"):
        parse_run_config({"server": {"api_key": 5}})


def test_serve_help_lists_the_admission_and_plugin_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--rate-limit-requests", "--rate-limit-burst", "--rate-limit-tokens",
                 "--api-key-file", "--max-num-queued-requests", "--max-num-queued-tokens",
                 "--plugins"):
        assert flag in out


def test_precheck_refuses_an_empty_request_bucket_without_drawing_on_it():
    clock = FakeClock()
    admission = Admission(AdmissionLimits(rate_limit_requests=1, rate_limit_tokens=10), clock)
    for _ in range(5):
        admission.precheck("a")  # checks only: the one request of the burst stays
    admission.admit("a", 8, 2).release()
    with pytest.raises(APIError) as refused:
        admission.precheck("a")
    assert refused.value.status == 429 and refused.value.type == "requests"
