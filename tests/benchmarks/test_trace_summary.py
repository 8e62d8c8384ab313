"""Trace summary arithmetic on a hand-made Perfetto trace: two steps, two streams, one gap."""

from __future__ import annotations

import gzip
import json

import pytest

from pjinfer.benchmarks.trace_summary import summarize_dir


def _write(tmp_path, events):
    folder = tmp_path / "plugins" / "profile" / "2026_12_01"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_busy_idle_and_heaviest_kernels(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    gpu = [("gemv", 0, 10), ("gemv", 5, 10), ("attn", 20, 5),  # overlap on two streams
           ("gemv", 100, 10), ("attn", 115, 10)]
    events = meta + [{"ph": "X", "pid": 1, "tid": i % 2, "name": n, "ts": ts, "dur": d}
                     for i, (n, ts, d) in enumerate(gpu)]
    events.append({"ph": "X", "pid": 2, "tid": 0, "name": "python", "ts": 0, "dur": 500})
    _write(tmp_path, events)
    s = summarize_dir(tmp_path, steps=2)
    assert s["device_events"] == 5 and s["kernels_per_step"] == 2.5
    # busy: [0, 15] + [20, 25] + [100, 110] + [115, 125] = 40 us; window 125 us
    assert s["busy_us_per_step"] == pytest.approx(20)
    assert s["window_us_per_step"] == pytest.approx(62.5)
    assert s["idle_us_per_step"] == pytest.approx(42.5)
    assert [k["name"] for k in s["top_kernels"]] == ["gemv", "attn"]
    assert s["top_kernels"][0] == {"name": "gemv", "calls_per_step": 1.5, "us_per_step": 15}
    assert s["one_layer"] == []  # two attention kernels: no whole layer between a 2nd and 3rd


def test_one_layer_lists_a_middle_layers_kernels_in_order(tmp_path):
    """Three layers of norm -> gemm -> attention: the listing runs from the second attention
    kernel to the third, with the op names the trace gives."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
    names = ["embed"] + ["fusion.1", "gemm", "paged_decode_attention"] * 3 + ["lm_head"]
    events = meta + [{"ph": "X", "pid": 1, "tid": 0, "name": n, "ts": 10 * i, "dur": i + 1,
                      "args": {"hlo_op": f"{n}.{i}", "tf_op": f"jit(step)/op{i}",
                               "correlation_id": i}}
                     for i, n in enumerate(names)]
    _write(tmp_path, events[:1] + events[1:][::-1])  # the trace's order is not time's
    layer = summarize_dir(tmp_path, steps=1)["one_layer"]
    # kernel i starts at 10 i and lasts i + 1 us: idle before it 10 - i us
    assert [(k["name"], k["us"], k["idle_before_us"]) for k in layer] == [
        ("paged_decode_attention", 7.0, 4.0), ("fusion.1", 8.0, 3.0), ("gemm", 9.0, 2.0)]
    assert layer[1] == {"name": "fusion.1", "us": 8.0, "idle_before_us": 3.0, "own_us": 8.0,
                        "hlo_op": "fusion.1.7", "tf_op": "jit(step)/op7"}


def test_one_layer_idle_and_own_time_count_from_the_latest_end_on_any_stream(tmp_path):
    """A kernel on a second stream that outlasts the one before: idle is measured from the
    later end, overlap is no idle, and a kernel's own time is what it runs past every
    earlier kernel's end (a kernel launched early and waiting is not charged for the wait)."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
    gpu = [("attention", 0, 5, 0), ("long", 6, 20, 1), ("short", 7, 2, 0),
           ("attention", 30, 5, 0), ("gemm", 34, 3, 1), ("attention", 50, 5, 0)]
    _write(tmp_path, meta + [{"ph": "X", "pid": 1, "tid": tid, "name": n, "ts": ts, "dur": d}
                             for n, ts, d, tid in gpu])
    layer = summarize_dir(tmp_path, steps=1)["one_layer"]
    assert [(k["name"], k["idle_before_us"], k["own_us"]) for k in layer] == [
        ("attention", 4.0, 5.0), ("gemm", 0.0, 2.0)]


def test_no_trace_or_no_device_is_said(tmp_path):
    assert "error" in summarize_dir(tmp_path, steps=3)
    _write(tmp_path, [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host"}},
                      {"ph": "X", "pid": 2, "name": "python", "ts": 0, "dur": 5}])
    assert summarize_dir(tmp_path, steps=3) == {"steps": 3, "device_events": 0,
                                                "processes": ["/host"]}
