"""`nanoserve bench serve`'s goodput: SLO attainment per rate and the bracket its sweep narrows."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("aiohttp")  # the benchmark's HTTP client (pinned in the test extra)

from nanoserve.bench import serving


def result(ok=True, ttft=0.1, e2e=1.1, tokens=51):
    return serving.RequestResult(ok=ok, ttft=ttft, e2e=e2e, output_tokens=tokens)


def test_slo_attainment_counts_both_bounds_and_failures():
    good = result()  # TTFT 100 ms, TPOT (1.1 - 0.1) / 50 = 20 ms
    slow_first = result(ttft=0.6, e2e=1.6)
    slow_tokens = result(e2e=2.1)  # TPOT 40 ms
    one_token = result(tokens=1, e2e=0.1)  # no TPOT: judged by TTFT alone
    failed = result(ok=False)
    rs = [good, slow_first, slow_tokens, one_token, failed]
    assert serving.slo_attainment(rs, 500, 25) == pytest.approx(2 / 5)
    assert serving.slo_attainment(rs, 1000, 50) == pytest.approx(4 / 5)
    assert serving.slo_attainment([], 500, 25) == 0


def test_goodput_bounds():
    s = [{"request_rate": r, "slo_attainment": a} for r, a in ((4, 1.0), (8, 0.95), (16, 0.5), (32, 0.99), ("inf", 0))]
    # 32 passes again, but 16 failed below it: the goodput is the rate up to which all pass.
    assert serving.goodput_bounds(s) == (8, 16)
    assert serving.goodput_bounds(s[:2]) == (8, None)
    assert serving.goodput_bounds([s[2]]) == (0.0, 16)
    lo, hi = serving.goodput_bounds([*s[:2], {"request_rate": "inf", "slo_attainment": 0.9}])
    assert math.isinf(lo) and hi is None
    line = serving.goodput_line({"ttft_ms": 500, "tpot_ms": 25, "rate": 8.0, "first_failing_rate": 16.0})
    assert "up to 8.00 req/s" in line and "TTFT <= 500 ms" in line and "TPOT <= 25 ms" in line


def test_goodput_flag_parsing():
    assert serving.parse_goodput("500,25") == (500.0, 25.0)
    for bad in ("500", "a,b", "0,25"):
        with pytest.raises(SystemExit):
            serving.parse_goodput(bad)


def test_summary_keeps_each_request_and_prints_the_ttft_tail(capsys):
    rs = [
        serving.RequestResult(ok=True, ttft=t, e2e=t + 1.0, output_tokens=11, itl=[0.1, 0.2], start=10.0 + i)
        for i, t in enumerate((0.05, 2.5, 0.07))
    ]
    s = serving.summarize(4.0, [*rs, result(ok=False)], 3.0, None, t0=10.0)
    assert [r["sent_s"] for r in s["requests"]] == [0.0, 1.0, 2.0]  # the failed request has none
    assert s["requests"][1] == {"sent_s": 1.0, "ttft_ms": 2500.0, "e2e_ms": 3500.0, "max_itl_ms": 200.0}
    serving.print_summary(s)
    assert (
        "slowest TTFT: 2500 ms (sent at 1.00 s), 70 ms (sent at 2.00 s), 50 ms (sent at 0.00 s)"
        in capsys.readouterr().out
    )
