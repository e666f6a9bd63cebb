"""plan.py: KV sizes from configs, the window model by hand, against an LRU simulation, the CLI."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lru_sim import simulate

from sglang_tierstore.tools.plan import (
    EmpiricalGaps,
    Gaps,
    LogNormalGaps,
    kv_bytes_per_token,
    main,
    plan,
)

ROOT = Path(__file__).resolve().parent.parent
PHI_1 = 0.8413447460685429  # standard normal cdf at 1 and 2
PHI_2 = 0.9772498680518208

LLAMA_8B = {
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "q_lora_rank": 1536, "torch_dtype": "bfloat16",
}
GEMMA3_4B = {  # multimodal: the language model under text_config, dtype at the top
    "torch_dtype": "bfloat16",
    "text_config": {"num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "hidden_size": 2560},
    "vision_config": {"num_hidden_layers": 27, "hidden_size": 1152, "num_attention_heads": 16},
}


def test_kv_bytes_per_token_gqa_mla_multimodal() -> None:
    assert kv_bytes_per_token(LLAMA_8B) == 2 * 32 * 8 * 128 * 2 == 128 << 10
    assert kv_bytes_per_token(DEEPSEEK_V3) == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(GEMMA3_4B) == 2 * 34 * 4 * 256 * 2
    mha = {k: v for k, v in LLAMA_8B.items() if k != "num_key_value_heads"}
    assert kv_bytes_per_token(mha) == 4 * kv_bytes_per_token(LLAMA_8B)  # kv heads default to attention heads


def test_kv_bytes_per_token_dtypes() -> None:
    base = kv_bytes_per_token(LLAMA_8B)
    assert kv_bytes_per_token(LLAMA_8B, "fp8_e4m3") == base // 2
    assert kv_bytes_per_token(LLAMA_8B, "float32") == base * 2
    assert kv_bytes_per_token(LLAMA_8B, "auto") == base
    assert kv_bytes_per_token(DEEPSEEK_V3, "fp8_e5m2") == 61 * 576
    assert kv_bytes_per_token({**LLAMA_8B, "torch_dtype": "float32"}) == base * 2
    assert kv_bytes_per_token({**LLAMA_8B, "torch_dtype": None, "dtype": "float16"}) == base  # transformers v5
    no_dtype = {k: v for k, v in LLAMA_8B.items() if k != "torch_dtype"}
    assert kv_bytes_per_token(no_dtype) == base


@pytest.mark.parametrize(
    "config,dtype,field",
    [
        ({k: v for k, v in LLAMA_8B.items() if k != "num_hidden_layers"}, None, "num_hidden_layers"),
        ({k: v for k, v in LLAMA_8B.items() if k != "num_attention_heads"}, None, "num_attention_heads"),
        ({**LLAMA_8B, "num_key_value_heads": 0}, None, "num_key_value_heads"),
        ({**LLAMA_8B, "num_hidden_layers": "32"}, None, "num_hidden_layers"),
        ({k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"}, None, "qk_rope_head_dim"),
        ({**GEMMA3_4B, "text_config": {"num_attention_heads": 8}}, None, "text_config.num_hidden_layers"),
        ({**LLAMA_8B, "torch_dtype": "int3"}, None, "torch_dtype"),
        (LLAMA_8B, "fp4", "dtype"),
    ],
)
def test_kv_bytes_per_token_names_the_bad_field(config: dict[str, Any], dtype: str | None, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        kv_bytes_per_token(config, dtype)


def test_gap_distributions() -> None:
    g = LogNormalGaps(median_s=100.0, sigma=1.0)
    assert g.cdf(100.0) == pytest.approx(0.5)
    assert g.cdf(100.0 * math.e) == pytest.approx(PHI_1)
    assert g.cdf(0.0) == 0.0 and g.cdf(math.inf) == 1.0
    assert g.quantile(PHI_2) == pytest.approx(100.0 * math.e**2)
    assert g.quantile(0.0) == 0.0 and g.quantile(1.0) == math.inf
    e = EmpiricalGaps((5.0, 1.0, 3.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0))
    assert e.samples[0] == 1.0  # sorted
    assert e.cdf(3.0) == 0.4 and e.cdf(2.9) == 0.2 and e.cdf(0.5) == 0.0 and e.cdf(9.0) == 1.0
    assert e.quantile(0.7) == 6.0  # the 7th sample, though 0.7 * 10 is 7.000000000000001 in floats
    assert e.quantile(0.35) == 3.0 and e.quantile(0.4) == 3.0 and e.quantile(1.0) == 9.0
    for p in (0.01, 0.1, 0.33, 0.5, 0.7, 0.99):
        assert e.cdf(e.quantile(p)) >= p
    for bad in ((), (1.0, -1.0), (math.nan,)):
        with pytest.raises(ValueError, match="samples"):
            EmpiricalGaps(bad)
    with pytest.raises(ValueError, match="sigma"):
        LogNormalGaps(10.0, 0.0)


def _plan(gaps: Gaps | None = None, **kw: Any) -> Any:
    """plan() with the hand-made numbers below: lambda 10 tokens/s, windows 100, 100e, 100e^2 s."""
    args: dict[str, Any] = {
        "gpu_tokens": 1000.0, "host_tokens": 1000.0 * math.e, "l3_tokens": 1000.0 * math.e**2, "insert_rate": 10.0,
        "gaps": gaps or LogNormalGaps(100.0, 1.0), "bytes_per_token": 100_000, "prefix_tokens": 1000.0,
        "recompute_s_per_token": 1e-4, "host_read_bytes_per_s": 1e10, "l3_read_bytes_per_s": 1e9,
    }
    args.update(kw)
    return plan(**args)


def test_shares_by_hand() -> None:
    p = _plan()
    assert p.windows_s == pytest.approx({"device": 100.0, "host": 100.0 * math.e, "storage": 100.0 * math.e**2})
    assert p.shares == pytest.approx({"device": 0.5, "host": PHI_1 - 0.5, "storage": PHI_2 - PHI_1, "miss": 1 - PHI_2})
    assert sum(p.shares.values()) == pytest.approx(1.0)


def test_host_window_is_its_own_capacity_not_the_sum() -> None:
    """Inclusive: the host also holds every device page, so its window is C_host / lambda."""
    p = _plan(host_tokens=2000.0)
    assert p.windows_s["host"] == pytest.approx(200.0)  # not (1000 + 2000) / 10
    assert p.shares["host"] == pytest.approx(LogNormalGaps(100.0, 1.0).cdf(200.0) - 0.5)


def test_a_tier_shorter_than_the_one_above_serves_nothing() -> None:
    p = _plan(host_tokens=500.0)
    assert p.shares["host"] == 0.0
    assert p.shares["storage"] == pytest.approx(PHI_2 - 0.5)
    p = _plan(l3_tokens=800.0)
    assert p.shares["storage"] == 0.0 and p.shares["miss"] == pytest.approx(1 - PHI_1)


def test_no_l3_and_unbounded_l3() -> None:
    p = _plan(l3_tokens=None)
    assert p.shares["storage"] == 0.0 and p.windows_s["storage"] == 0.0
    assert p.shares["miss"] == pytest.approx(1 - PHI_1)
    assert "l3_tokens" not in p.inputs
    assert p.l3_tokens_needed == pytest.approx(10.0 * LogNormalGaps(100.0, 1.0).quantile(0.9))  # what L3 would take
    p = _plan(l3_tokens=math.inf)
    assert p.windows_s["storage"] == math.inf and p.shares["miss"] == 0.0
    doc = json.loads(json.dumps(p.to_json(), allow_nan=False))
    assert doc["windows_s"]["storage"] == "inf" and doc["inputs"]["l3_tokens"] == "inf"
    assert doc["shares"] == pytest.approx(p.shares)


@pytest.mark.parametrize("target", [0.9, 0.95, 0.99])
def test_l3_needed_reaches_the_target(target: float) -> None:
    p = _plan(target_hit_share=target)
    assert p.l3_bytes_needed == p.l3_tokens_needed * 100_000
    again = _plan(l3_tokens=p.l3_tokens_needed)
    assert 1 - again.shares["miss"] == pytest.approx(target)
    r = random.Random(3)
    gaps = EmpiricalGaps(tuple(r.expovariate(1 / 300) for _ in range(1000)))
    p = _plan(gaps=gaps, target_hit_share=target)
    again = _plan(gaps=gaps, l3_tokens=p.l3_tokens_needed * (1 + 1e-12))  # past float rounding of C / lambda
    assert target <= 1 - again.shares["miss"] < target + 0.002


def test_l3_needed_is_zero_when_device_and_host_reach_the_target() -> None:
    assert _plan(host_tokens=1e6, l3_tokens=None).l3_tokens_needed == 0.0


def test_ttft_saved() -> None:
    p = _plan()
    # recompute 1000 tokens: 0.1 s; read 1e8 bytes: 0.01 s from host, 0.1 s from L3
    assert p.ttft_saved_s == pytest.approx({"device": 0.1, "host": 0.09, "storage": 0.0})
    assert p.expected_ttft_saved_s == pytest.approx(0.5 * 0.1 + (PHI_1 - 0.5) * 0.09)
    slow = _plan(l3_read_bytes_per_s=5e8)
    assert slow.ttft_saved_s["storage"] == pytest.approx(-0.1)  # reading slower than recomputing


@pytest.mark.parametrize(
    "bad",
    [
        {"gpu_tokens": -1.0}, {"host_tokens": math.nan}, {"l3_tokens": -5.0}, {"insert_rate": 0.0},
        {"insert_rate": math.inf}, {"bytes_per_token": 0}, {"bytes_per_token": 2.5}, {"prefix_tokens": -1.0},
        {"recompute_s_per_token": -1e-4}, {"host_read_bytes_per_s": 0.0}, {"l3_read_bytes_per_s": -1.0},
        {"target_hit_share": 1.0}, {"target_hit_share": 0.0},
    ],
)
def test_bad_inputs_name_the_argument(bad: dict[str, Any]) -> None:
    (name,) = bad
    with pytest.raises(ValueError, match=f"^{name}:"):
        _plan(**bad)


# Against the simulation. Background: 1000 tokens/s in 100-token entries; users: 5/s, 10-token
# prefixes, so returning traffic is 5% of what enters the cache. Tiers of 30k, 120k, 600k tokens:
# windows of about 29, 114 and 571 s. About 10,000 measured returns per case: a share's sampling
# error is at most 0.005. The model's own bias is measured below (about 0.015 at most, always the
# device share, too high): hits reloaded into upper tiers and refreshes of older entries push an
# entry down too, so real windows run 1 to 5% short of C / lambda. 0.03 covers both.
TOLERANCE = 0.03


def _mixture() -> EmpiricalGaps:
    """Quick returns, returns within minutes and stragglers: a lumpy, non-lognormal trace."""
    r = random.Random(7)
    return EmpiricalGaps(tuple(
        [r.expovariate(1 / 10) for _ in range(600)] + [r.uniform(40, 400) for _ in range(800)]
        + [r.expovariate(1 / 1500) for _ in range(600)]
    ))


@pytest.mark.parametrize(
    "gaps,gpu,host,l3",
    [
        (LogNormalGaps(100.0, 1.2), 30_000, 120_000, 600_000),  # every tier a real share
        (LogNormalGaps(15.0, 1.0), 30_000, 120_000, 600_000),  # mostly device
        (LogNormalGaps(800.0, 0.8), 30_000, 120_000, 600_000),  # storage or miss
        (LogNormalGaps(100.0, 1.2), 30_000, 120_000, None),  # no L3
        (LogNormalGaps(100.0, 1.2), 30_000, 15_000, 600_000),  # host smaller than device: serves nothing
        (_mixture(), 30_000, 120_000, 600_000),
    ],
    ids=["lognormal-100s", "lognormal-15s", "lognormal-800s", "no-l3", "small-host", "empirical"],
)
def test_shares_match_an_lru_simulation(
    gaps: LogNormalGaps | EmpiricalGaps, gpu: int, host: int, l3: int | None
) -> None:
    if isinstance(gaps, LogNormalGaps):
        median, sigma = math.log(gaps.median_s), gaps.sigma
        def draw(r: random.Random) -> float:
            return r.lognormvariate(median, sigma)
    else:
        samples = gaps.samples
        def draw(r: random.Random) -> float:
            return r.choice(samples)
    sim = simulate(
        gpu_tokens=gpu, host_tokens=host, l3_tokens=l3, background_rate=1000.0, entry_tokens=100, user_rate=5.0,
        prefix_tokens=10, draw_gap=draw, warmup_s=800.0, measure_s=2000.0, seed=1,
    )
    assert sim.returns > 9000
    p = plan(
        gpu_tokens=gpu, host_tokens=host, l3_tokens=l3, insert_rate=sim.insert_rate, gaps=gaps, bytes_per_token=1,
        prefix_tokens=1.0, recompute_s_per_token=0.0, host_read_bytes_per_s=1.0, l3_read_bytes_per_s=1.0,
    )
    for tier, share in sim.shares.items():
        assert share == pytest.approx(p.shares[tier], abs=TOLERANCE), (tier, sim.shares, p.shares)
    if host < gpu:
        assert sim.shares["host"] == 0.0
    if l3 is None:
        assert sim.shares["storage"] == 0.0


def test_returning_traffic_shortens_the_windows() -> None:
    """Where returns dominate, a tier's window is C over the rate tokens are placed in it, not the unique rate.

    Users' prefixes are 90% of the new tokens and most miss: a miss recomputes the prefix
    and a storage hit reloads it into host and device, so every tier takes in far more than
    the unique rate. plan() given the unique rate then overrates every tier; given each
    tier's placed rate (prefill tokens computed plus reloads), it matches again.
    """
    gaps = LogNormalGaps(100.0, 1.2)
    caps = {"device": 3000, "host": 12_000, "storage": 60_000}
    median, sigma = math.log(gaps.median_s), gaps.sigma
    sim = simulate(
        gpu_tokens=caps["device"], host_tokens=caps["host"], l3_tokens=caps["storage"], background_rate=100.0,
        entry_tokens=100, user_rate=10.0, prefix_tokens=90, draw_gap=lambda r: r.lognormvariate(median, sigma),
        warmup_s=800.0, measure_s=500.0, seed=1,
    )
    naive = plan(
        gpu_tokens=caps["device"], host_tokens=caps["host"], l3_tokens=caps["storage"], insert_rate=sim.insert_rate,
        gaps=gaps, bytes_per_token=1, prefix_tokens=1.0, recompute_s_per_token=0.0, host_read_bytes_per_s=1.0,
        l3_read_bytes_per_s=1.0,
    )
    assert sim.shares["miss"] > naive.shares["miss"] + 0.1
    for tier, cap in caps.items():
        assert sim.placed_rates[tier] > 1.5 * sim.insert_rate
        assert sim.windows_s[tier] == pytest.approx(cap / sim.placed_rates[tier], rel=0.08)
        assert sim.windows_s[tier] < 0.6 * naive.windows_s[tier]
    placed = plan(
        gpu_tokens=caps["device"], host_tokens=caps["host"], l3_tokens=caps["storage"], insert_rate=sim.insert_rate,
        gaps=gaps, bytes_per_token=1, prefix_tokens=1.0, recompute_s_per_token=0.0, host_read_bytes_per_s=1.0,
        l3_read_bytes_per_s=1.0, tier_rates=sim.placed_rates,
    )
    for tier in (*caps, "miss"):
        assert sim.shares[tier] == pytest.approx(placed.shares[tier], abs=TOLERANCE)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sglang_tierstore.tools.plan", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=False,
    )


CLI_BASE = [
    "--gpu-tokens", "400000", "--insert-rate", "20000", "--prefix-tokens", "8000",
    "--recompute-ms-per-1k-tokens", "60", "--host-gbps", "20", "--l3-gbps", "5",
]


def test_cli_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    out = _cli("--model-config", str(tmp_path), "--host-gb", "200", "--l3-gb", "2000", "--gap-median", "600",
               "--gap-sigma", "1.5", "--json", *CLI_BASE)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    bpt = 128 << 10
    expected = plan(
        gpu_tokens=400_000, host_tokens=200e9 / bpt, l3_tokens=2000 * 2**30 / bpt, insert_rate=20_000,
        gaps=LogNormalGaps(600.0, 1.5), bytes_per_token=bpt, prefix_tokens=8000, recompute_s_per_token=60e-6,
        host_read_bytes_per_s=20e9, l3_read_bytes_per_s=5e9,
    ).to_json()
    assert doc["inputs"]["bytes_per_token"] == bpt
    assert doc["windows_s"] == pytest.approx(expected["windows_s"])
    assert doc["shares"] == pytest.approx(expected["shares"])
    assert doc["l3_bytes_needed"] == pytest.approx(expected["l3_bytes_needed"])
    assert doc["ttft_saved_s"] == pytest.approx(expected["ttft_saved_s"])


def test_cli_gaps_file_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "turns.jsonl"
    gaps = [None, 5, 50, None, 500]  # a user's first turn has no gap
    trace.write_text("".join(json.dumps({"user": i, "gap_s": g}) + "\n" for i, g in enumerate(gaps)))
    listed = tmp_path / "gaps.json"
    listed.write_text(json.dumps([5, 50, None, 500]))
    docs = []
    for path in (trace, listed):
        args = ["--bytes-per-token", "1000", "--host-tokens", "2e6", "--gaps-file", str(path), "--json", *CLI_BASE]
        assert main(args) == 0
        docs.append(json.loads(capsys.readouterr().out))
    assert docs[0] == docs[1]
    # windows 20 s and 100 s: the 5 s gap on the device, 50 s in host, 500 s missed (no L3)
    assert docs[0]["shares"] == pytest.approx({"device": 1 / 3, "host": 1 / 3, "storage": 0.0, "miss": 1 / 3})
    assert main(["--bytes-per-token", "1000", "--host-tokens", "2e6", "--l3-gb", "inf", "--gaps-file", str(trace),
                 *CLI_BASE]) == 0
    table = capsys.readouterr().out
    assert "storage" in table and "unbounded" in table and "L3 for 90% cached" in table


@pytest.mark.parametrize(
    "change,named",
    [
        ({"--insert-rate": "0"}, "--insert-rate"),
        ({"--gpu-tokens": "lots"}, "--gpu-tokens"),
        ({"--target-hit-share": "1.5"}, "--target-hit-share"),
        ({"--gap-sigma": "1"}, "--gap-median"),  # sigma without a median
        ({"--kv-dtype": "fp8_e4m3"}, "--kv-dtype"),  # only with --model-config
        ({"--gaps-file": "/nonexistent/gaps.json"}, "--gaps-file"),
        ({"--model-config": "/nonexistent", "--bytes-per-token": None}, "--model-config"),
    ],
)
def test_cli_bad_arguments_are_named(
    change: dict[str, str | None], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base: dict[str, str | None] = {"--bytes-per-token": "1000", "--host-tokens": "2e6"}
    base.update(zip(CLI_BASE[::2], CLI_BASE[1::2]))
    base.update(change)
    with pytest.raises(SystemExit) as exc:
        main([a for flag, value in base.items() if value is not None for a in (flag, value)])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_cli_bad_argument_exits_nonzero() -> None:
    out = _cli("--bytes-per-token", "1000", "--host-tokens", "-3", "--gap-median", "60", "--gap-sigma", "1", *CLI_BASE)
    assert out.returncode == 2 and "--host-tokens" in out.stderr
