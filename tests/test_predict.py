"""predict.py: the LRU order it keeps, its limits by hand, how pools and think times move the
shares, the ranges one run lands in, bad inputs named, the CLI."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest

from sglang_tierstore.tools.plan import LogNormalGaps
from sglang_tierstore.tools.predict import (
    SHARES,
    Schedule,
    Workload,
    _Recency,
    main,
    predict,
    replay,
)

BASE = Workload(users=24, arrival_rate=0.3, turns=3, first_tokens=512, later_tokens=256, output_tokens=32,
                system_tokens=1024, tenants=4, think=LogNormalGaps(20.0, 0.8), prefill_s_per_token=0.0013,
                decode_s_per_token=0.05, page_tokens=16)
HOT = 4 * 1024
# Returning histories of 544 and 832 own tokens behind the 1,024-token system prompt: the cache
# holds every token but the reply's last, in whole 16-token pages, so one page of each misses.
WHOLE = (528 + 816) / (544 + 832)


def shares(w: Workload = BASE, **pools: Any) -> dict[str, float]:
    return predict(w, **{"gpu_tokens": 8192, "host_tokens": 16384, "l3_tokens": None, "draws": 16, **pools}).shares


def test_recency_matches_a_list_kept_in_lru_order() -> None:
    rng = random.Random(7)
    fast, order = _Recency(4000), []  # order: (key, tokens), least recent first
    for _ in range(2000):
        key, tokens = rng.randrange(60), rng.randrange(1, 500)
        order = [e for e in order if e[0] != key] + [(key, tokens)]
        fast.touch(key, tokens)
        probe = rng.choice(order)[0]
        keys = [k for k, _ in order]
        assert fast.ahead(probe) == sum(t for _, t in order[keys.index(probe) + 1:])
    assert fast.total == sum(t for _, t in order)


def test_pools_that_hold_everything_serve_all_but_the_last_page_from_the_device() -> None:
    s = shares(gpu_tokens=10**7, host_tokens=10**7)
    assert s == pytest.approx({"device": WHOLE, "host": 0.0, "storage": 0.0, "miss": 1 - WHOLE})
    # one-token pages: only each reply's last token misses
    s = shares(dataclasses.replace(BASE, page_tokens=1), gpu_tokens=10**7, host_tokens=10**7)
    assert s["miss"] == pytest.approx(2 / (544 + 832)) and s["device"] == pytest.approx(1 - s["miss"])


def test_a_device_left_only_the_system_prompts_sends_every_return_to_the_host() -> None:
    s = shares(gpu_tokens=HOT, host_tokens=10**7)
    assert s["device"] == 0 and s["host"] == pytest.approx(WHOLE)
    s = shares(gpu_tokens=HOT, host_tokens=HOT, l3_tokens=10**7)
    assert s["storage"] == pytest.approx(WHOLE)
    assert shares(gpu_tokens=HOT, host_tokens=HOT)["miss"] == pytest.approx(1.0)


def test_bigger_pools_and_shorter_thinks_keep_more_upstairs() -> None:
    small, big = shares(gpu_tokens=8192), shares(gpu_tokens=16384)
    assert 0 < small["device"] < big["device"]
    assert shares(host_tokens=12288)["miss"] > shares(host_tokens=24576)["miss"]
    quick = shares(dataclasses.replace(BASE, think=LogNormalGaps(5.0, 0.8)))
    slow = shares(dataclasses.replace(BASE, think=LogNormalGaps(60.0, 0.8)))
    assert quick["device"] > small["device"] > slow["device"]
    with_l3 = shares(l3_tokens=10**7)
    # what missed now comes from L3 (a little less of it: reading is faster than recomputing,
    # so replies end sooner and less is touched ahead of a history)
    assert with_l3["miss"] == pytest.approx(1 - WHOLE)
    assert with_l3["storage"] == pytest.approx(small["miss"] - (1 - WHOLE), abs=0.03)


def test_prediction_is_seeded_sums_to_one_and_its_ranges_hold_the_mean() -> None:
    a = predict(BASE, gpu_tokens=8192, host_tokens=16384, l3_tokens=10**6, draws=32, seed=3)
    assert a == predict(BASE, gpu_tokens=8192, host_tokens=16384, l3_tokens=10**6, draws=32, seed=3)
    assert sum(a.shares.values()) == pytest.approx(1.0)
    for k in SHARES:
        lo, hi = a.share_ranges[k]
        assert lo - 1e-12 <= a.shares[k] <= hi + 1e-12
    assert a.share_ranges["device"][1] > a.share_ranges["device"][0]  # one run of 48 returns is not the mean
    assert a.hot_shared_tokens == HOT and a.in_flight_tokens > 0 and a.returns == 32 * 24 * 2
    r = a.rates
    assert r["placed_device"] >= r["placed_host"] >= r["placed_storage"] == r["computed"] > 0
    assert r["touched"] > r["computed"]  # returning histories move ahead of older ones
    assert a.windows_s["device"] == pytest.approx((8192 - HOT - a.in_flight_tokens) / r["touched"])
    json.dumps(a.to_json())


def test_replaying_one_draw_is_predicting_from_it_alone() -> None:
    pools = {"gpu_tokens": 8192, "host_tokens": 16384, "l3_tokens": 10**6}
    one = replay(BASE, Schedule.draw(BASE, random.Random("5/0")), **pools)
    assert one == pytest.approx(predict(BASE, draws=1, seed=5, **pools).shares)
    # a measured schedule: everyone at once, coming back after 1 s, is all on the device
    at_once = Schedule(tuple(0.0 for _ in range(24)), tuple((1.0, 1.0) for _ in range(24)))
    assert replay(BASE, at_once, gpu_tokens=10**6, host_tokens=10**6, l3_tokens=None)["device"] == pytest.approx(WHOLE)
    with pytest.raises(ValueError, match="^schedule.arrivals"):
        replay(BASE, Schedule((0.0,), ((1.0, 1.0),)), **pools)
    with pytest.raises(ValueError, match="^schedule.thinks"):
        replay(BASE, Schedule(at_once.arrivals, tuple((1.0,) for _ in range(24))), **pools)


def test_a_measured_schedule_is_replayed_at_its_send_times() -> None:
    arrivals = tuple(3.0 * i for i in range(24))
    soon = Schedule(arrivals, (), sends=tuple((a, a) for a in arrivals))  # each turn as soon as its reply ends
    late = Schedule(arrivals, (), sends=tuple((500.0, 900.0) for _ in arrivals))  # everyone back at once, late
    pools = {"gpu_tokens": 8192, "host_tokens": 16384, "l3_tokens": None}
    assert replay(BASE, soon, **pools)["device"] > 0.5 > replay(BASE, late, **pools)["device"]
    with pytest.raises(ValueError, match="^schedule.sends"):
        replay(BASE, Schedule(arrivals, (), sends=tuple((1.0,) for _ in arrivals)), **pools)


def test_requests_beyond_max_running_wait_and_hold_no_kv() -> None:
    one = predict(dataclasses.replace(BASE, max_running=1), gpu_tokens=8192, host_tokens=16384, l3_tokens=None, draws=8)
    many = predict(BASE, gpu_tokens=8192, host_tokens=16384, l3_tokens=None, draws=8)
    assert one.in_flight_tokens == 0 < many.in_flight_tokens  # admitted only when nothing else runs


def test_a_few_returns_still_give_finite_rates() -> None:
    p = predict(dataclasses.replace(BASE, users=1, turns=2), gpu_tokens=8192, host_tokens=16384, l3_tokens=None)
    assert p.returns == 64 and 0 < p.rates["touched"] < 10**4 and p.windows_s["device"] > 0


def test_bad_schedules_are_named() -> None:
    with pytest.raises(ValueError, match="^schedule.arrivals: expected non-negative finite seconds, got nan"):
        Schedule((float("nan"),), ((1.0, 1.0),))
    with pytest.raises(ValueError, match="^schedule.thinks"):
        Schedule((0.0,), ((-1.0, 1.0),))
    with pytest.raises(ValueError, match="^turns: expected more than one turn"):
        replay(dataclasses.replace(BASE, turns=1), Schedule((0.0,) * 24, ((),) * 24), gpu_tokens=1, host_tokens=1,
               l3_tokens=None)


def test_backup_users_push_histories_down() -> None:
    busy = dataclasses.replace(BASE, backup_rate=0.2, backup_tokens=2048)
    assert shares(busy)["device"] < shares()["device"]


@pytest.mark.parametrize(("change", "name"), [
    ({"users": 0}, "users"), ({"turns": True}, "turns"), ({"arrival_rate": 0.0}, "arrival_rate"),
    ({"first_tokens": -1}, "first_tokens"), ({"page_tokens": 0}, "page_tokens"),
    ({"decode_s_per_token": float("inf")}, "decode_s_per_token"), ({"backup_rate": -1.0}, "backup_rate"),
])
def test_bad_workloads_name_the_field(change: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        dataclasses.replace(BASE, **change)


def test_nothing_returning_and_bad_pools_are_named() -> None:
    with pytest.raises(ValueError, match="^turns: expected more than one turn"):
        predict(dataclasses.replace(BASE, turns=1), gpu_tokens=8192, host_tokens=16384, l3_tokens=None)
    with pytest.raises(ValueError, match="^gpu_tokens"):
        predict(BASE, gpu_tokens=-1, host_tokens=16384, l3_tokens=None)
    with pytest.raises(ValueError, match="^draws"):
        predict(BASE, gpu_tokens=8192, host_tokens=16384, l3_tokens=None, draws=0)


CLI = ["--users", "24", "--arrival-rate", "0.3", "--turns", "3", "--first-tokens", "512", "--later-tokens", "256",
       "--output-tokens", "32", "--system-tokens", "1024", "--tenants", "4", "--think-median", "20",
       "--think-sigma", "0.8", "--prefill-ms-per-1k-tokens", "1300", "--decode-ms-per-token", "50",
       "--page-tokens", "16", "--gpu-tokens", "8192", "--host-tokens", "16384", "--draws", "16"]


def test_cli_table_and_json_agree_with_the_function(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*CLI, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shares"] == pytest.approx(shares())
    assert main([*CLI, "--max-running", "3"]) == 0
    assert "no L3" in capsys.readouterr().out
    assert main([*CLI, "--l3-gb", "8", "--bytes-per-token", "12288"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split() == ["tier", "window", "share", "one", "run,", "95%"]
    storage = next(ln for ln in text.splitlines() if ln.startswith("storage"))
    assert "no L3" not in storage and storage.split()[1].replace(",", "").replace(".", "").isdigit()


@pytest.mark.parametrize(("extra", "message"), [
    (["--l3-gb", "8"], "--l3-gb needs --bytes-per-token"), (["--users", "0"], "users: expected a positive integer"),
])
def test_cli_bad_arguments_are_named(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*CLI, *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
