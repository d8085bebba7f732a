# paged_ab's mixed level read by window: the short requests grouped by when they started, relative to the
# first long request, with the long requests' first tokens and ends placed in their windows.
from perf.paged_ab import by_window


def _req(start, rtf, ttfp=0.2, ttft=None, e2e=None, status="ok"):
    return {"start": start, "rtf": rtf, "ttfp": ttfp, "ttft": ttft, "e2e": e2e, "status": status}


def test_windows_group_short_requests_by_start_and_place_the_long_ones_marks():
    longs = [_req(100.0, 1.0, ttft=15.3, e2e=73.2), _req(100.5, 1.1, ttft=27.6, e2e=78.8)]
    short = [_req(101.0, 0.7, ttfp=0.3), _req(109.0, 0.9, ttfp=0.1), _req(112.0, 0.5),
             _req(103.0, None, status="error"), _req(131.0, 0.4)]  # fmt: skip
    w = by_window(short, longs)
    assert [x["from_s"] for x in w] == [0.0, 10.0, 20.0, 30.0]
    assert w[0]["requests"] == 2 and w[0]["rtf"] == 0.8 and w[0]["ttfp_ms"] == 200  # the failed one left out
    assert w[1]["requests"] == 1 and w[1]["long_first_tokens_s"] == [15.3]
    assert w[2] == {"from_s": 20.0, "requests": 0, "ttfp_ms": None, "rtf": None, "long_first_tokens_s": [28.1],
                    "long_ends_s": []}  # fmt: skip
    assert w[3]["rtf"] == 0.4 and w[3]["long_first_tokens_s"] == []
    assert by_window([], longs) == []
