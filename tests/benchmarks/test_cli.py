"""`pjinfer bench ...` end to end on CPU with the demo model: each writes a complete JSON record."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pjinfer.benchmarks.cli import main

SMALL_ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--no-progress",
                "--hbm-bandwidth", "0.05", "--peak-tflops", "0.1"]
COMMON_KEYS = {"schema_version", "command", "argv", "settings", "started_at", "finished_at",
               "software", "results"}


def _run(tmp_path, argv: list[str]) -> dict:
    path = tmp_path / "out.json"
    assert main([*argv, "--output-json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert COMMON_KEYS <= set(record)
    assert record["argv"][0] == argv[0] and record["software"]["python"]
    return record


def test_throughput_random(tmp_path):
    rec = _run(tmp_path, ["throughput", "--num-prompts", "5", "--input-len", "12",
                          "--output-len", "4", "--warmup-requests", "1",
                          "--no-engine-warmup", *SMALL_ENGINE])
    res = rec["results"]
    assert res["num_requests"] == 5 and res["input_tokens"] == 60
    assert res["output_tokens"] == 20  # ignore_eos forces every length
    assert res["output_tokens_per_s"] == pytest.approx(20 / res["elapsed_s"])
    assert res["num_steps"] >= 4 and res["num_preemptions"] == 0
    assert 0 < res["median_ttft_ms"] <= res["p99_ttft_ms"] < res["elapsed_s"] * 1e3
    assert 0 < res["median_tpot_ms"] <= res["p99_tpot_ms"]
    assert rec["device"]["device_kind"] and rec["startup_s"] > 0
    phases = rec["startup_phases"]  # --no-engine-warmup: no step_load / compile phase
    assert {"imports", "weights", "tokenizer", "kv_cache", "first_token"} <= set(phases)
    # the tokenizer loads beside the other phases: tokenizer_wait is what it added
    engine = sum(v for k, v in phases.items() if k not in ("process_before_engine",
                                                           "first_token", "tokenizer"))
    # phases cover the start-up but for the moments between them: 5%, or 0.1 s on a busy
    # 2-core machine where a 0.5 s start-up left 26 ms between phases
    assert engine == pytest.approx(rec["startup_s"], rel=0.05, abs=0.1)
    assert rec["process_to_first_token_s"] > rec["startup_s"]
    assert rec["device_memory"] == {}  # the pool against the largest step: GPU only
    assert rec["engine_args"]["max_num_seqs"] == 8
    assert rec["ceilings"]["source"] == "given"
    assert 0 < rec["ratios"]["output_tokens_per_s_vs_roofline"]


def test_throughput_synthetic_sharegpt_fits_context(tmp_path):
    rec = _run(tmp_path, ["throughput", "--dataset", "synthetic-sharegpt", "--num-prompts", "3",
                          "--warmup-requests", "0", "--no-engine-warmup", *SMALL_ENGINE])
    ds = rec["dataset"]
    assert ds["distribution"]["input"]["target_mean"] == 202
    assert rec["results"]["output_tokens"] == round(ds["mean_output_len"] * 3)


def test_beam(tmp_path):
    rec = _run(tmp_path, ["beam", "--num-prompts", "2", "--input-len", "20", "--output-len",
                          "3", "--beam-width", "2", "--no-engine-warmup",
                          "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                          "--no-progress"])
    res = rec["results"]
    assert res["beam_output_tokens"] == res["greedy_output_tokens"] == 2 * 2 * 3
    assert res["beam_over_greedy"] == pytest.approx(
        res["beam_output_tokens_per_s"] / res["greedy_output_tokens_per_s"])
    assert rec["engine_args"]["enable_prefix_caching"] is True


def test_latency(tmp_path):
    rec = _run(tmp_path, ["latency", "--batch-size", "2", "--input-len", "8", "--output-len",
                          "5", "--num-iters", "2", "--num-iters-warmup", "1", *SMALL_ENGINE])
    res = rec["results"]
    assert res["num_iters"] == 2 and res["e2e_s"]["count"] == 2
    assert res["ttft_s"]["count"] == 4 and res["tpot_s"]["count"] == 4
    assert res["ttft_s"]["median"] < res["e2e_s"]["median"]
    assert rec["timed"]["num_compiles"] == 0  # warm-up iterations compiled every shape
    assert rec["roofline"]["tpot_s"] > 0 and rec["ratios"]["tpot_roofline_over_median"] > 0
    # usable as printed: the ratio is the record's own roofline over its own median
    assert rec["ratios"]["tpot_roofline_over_median"] == pytest.approx(
        rec["roofline"]["tpot_s"] / res["tpot_s"]["median"])


def test_roofline_record_feeds_ceilings_from(tmp_path):
    path = tmp_path / "ceilings.json"
    assert main(["roofline", "--hbm-bandwidth", "4.5", "--peak-tflops", "800", "--batch-size",
                 "1", "--input-len", "16", "--output-len", "4", "--output-json", str(path)]) == 0
    roof = json.loads(path.read_text())
    assert roof["ceilings"]["hbm_tb_per_s"] == 4.5 and roof["roofline"]["decode_steps"] == 3
    # the weights-only floor, recomputed from the record's own terms and ceilings
    step = roof["roofline"]["work"]["first_decode_step"]
    assert roof["roofline"]["tpot_weights_only_s"] == pytest.approx(
        (step["layer_weight_bytes"] + step["final_norm_bytes"] + step["lm_head_bytes"]) / 4.5e12)
    rec = _run(tmp_path, ["throughput", "--num-prompts", "2", "--input-len", "8",
                          "--output-len", "3", "--warmup-requests", "0", "--no-engine-warmup",
                          "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                          "--no-progress", "--ceilings-from", str(path)])
    assert rec["ceilings"]["source"].startswith("from ") and rec["ceilings"]["hbm_tb_per_s"] == 4.5
    ratios, roof_t = rec["ratios"], rec["roofline"]
    assert ratios["output_tokens_per_s_vs_roofline"] == pytest.approx(
        rec["results"]["output_tokens_per_s"] / roof_t["output_tokens_per_s"])
    assert roof_t["work"]["lm_head_flops"] == 2 * 6 * 512 * 128  # one logits row per output


# ---- serve, against the real server in this process ---------------------------------------
@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    uvicorn = pytest.importorskip("uvicorn")
    from pjinfer.engine.async_engine import AsyncEngine
    from pjinfer.engine.config import EngineConfig
    from pjinfer.server.app import build_app

    engine = AsyncEngine(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, warmup=False))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_serve_counts_every_request(tmp_path, server_url):
    rec = _run(tmp_path, ["serve", "--base-url", server_url, "--num-prompts", "6",
                          "--input-len", "10", "--output-len", "5", "--request-rate", "50",
                          "--max-concurrency", "4", "--no-progress"])
    res = rec["results"]
    assert res["completed"] == 6 and res["failed"] == 0 and res["num_sent"] == 6
    assert res["total_output_tokens"] == 30 and res["output_tokens_short"] == 0
    assert res["total_input_tokens"] == 60
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert res[key]["count"] > 0 and res[key]["median"] > 0
    assert res["ttft_s"]["median"] <= res["e2e_s"]["median"]
    assert rec["server"]["model"]


def test_serve_records_failures(tmp_path, server_url):
    path = tmp_path / "out.json"
    # token ids beyond the demo vocabulary: the server rejects each request with HTTP 400
    argv = ["serve", "--base-url", server_url, "--num-prompts", "3", "--input-len", "4",
            "--output-len", "2", "--no-progress", "--output-json", str(path),
            "--model", str(_big_vocab_model(tmp_path))]
    assert main(argv) == 1
    res = json.loads(path.read_text())["results"]
    assert res["failed"] == 3 and res["completed"] == 0 and "HTTP 400" in res["errors"][0]


def _big_vocab_model(tmp_path):
    from pjinfer.demo import DEMO_MODEL_DIR

    cfg = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    cfg["vocab_size"] = 10_000_000  # ids drawn from here almost surely exceed 512
    folder = tmp_path / "bigvocab"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
