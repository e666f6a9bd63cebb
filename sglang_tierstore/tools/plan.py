"""Residency planner: which tier serves a returning prefix, and how much L3 a target needs.

An LRU tier of capacity ``C`` tokens fed by unique insertions at ``λ`` tokens/s keeps an
entry about ``W = C / λ`` seconds after its last use. HiCache is inclusive write-through:
every page on the device (L1) is also in host memory (L2) and in storage (L3), so each
tier's window is its own capacity over ``λ`` (the host's is ``C_host / λ``, not
``(C_gpu + C_host) / λ``). A user returning ``g`` seconds after its previous turn finds its
prefix in the highest tier whose window exceeds ``g``; a tier whose window is no longer
than an upper tier's serves nothing. Over a distribution of return gaps ``G`` the device
serves ``P(G <= W_gpu)``, the host ``P(W_gpu < G <= max(W_gpu, W_host))``, and so on
(the boundary carries no weight for a continuous ``G``; for samples, a tier serves gaps
up to and including its window).

``λ`` is what enters the cache: prefill tokens computed per second, recomputed misses
included. The model leaves out two things that also push an entry down a tier: prefixes
reloaded into it from a lower tier, and hits that move older entries ahead of it. Where
returning traffic is a small part of ``λ`` they cost a few percent of each window (within
0.02 of the shares a trace-driven LRU simulation gives, tests/test_plan.py); where it
dominates, each tier's window is its capacity over the rate tokens are placed in it, which
can be well above ``λ``, and the model overrates the upper tiers.

Standard library only: this is a planning tool, run before any server exists::

    python -m sglang_tierstore.tools.plan --model-config config.json --gpu-tokens 400000 \\
        --host-gb 200 --l3-gb 2000 --insert-rate 20000 --gap-median 600 --gap-sigma 1.5 \\
        --prefix-tokens 8000 --recompute-ms-per-1k-tokens 60 --host-gbps 20 --l3-gbps 5
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any, Protocol

GB = 10**9  # SGLang's --hicache-size unit (host_size * 1e9)
GiB = 1 << 30  # tierstore's capacity_gb unit
TIERS = ("device", "host", "storage")

_ITEMSIZE = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
}


def _itemsize(name: Any, field: str = "dtype") -> int:
    """Bytes per element of a KV dtype as HF configs and SGLang's --kv-cache-dtype spell it."""
    if isinstance(name, str):
        key = name.lower().removeprefix("torch.")
        if key in _ITEMSIZE:
            return _ITEMSIZE[key]
        if key.startswith(("fp8", "float8")):
            return 1
    raise ValueError(f"{field}: unknown dtype {name!r}")


def _positive_int(cfg: Mapping[str, Any], key: str, where: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{where}{key}: expected a positive integer, got {v!r}")
    return v


def kv_bytes_per_token(config: Mapping[str, Any], dtype: str | None = None) -> int:
    """KV cache bytes one token takes over all layers, from a Hugging Face ``config.json``.

    MHA/GQA keeps a key and a value per KV head; MLA (DeepSeek-style, ``kv_lora_rank``)
    keeps one compressed latent plus the rotary key. ``dtype`` (SGLang's
    ``--kv-cache-dtype``; ``"auto"`` or None means the model's) overrides the config's
    ``torch_dtype``/``dtype``, which defaults to 2 bytes. A multimodal config's language
    model under ``text_config`` is the one that caches KV. A bad or missing field raises
    ValueError naming it.
    """
    cfg: Mapping[str, Any] = config
    where = ""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        cfg, where = text, "text_config."
    if dtype is not None and dtype != "auto":
        itemsize = _itemsize(dtype)
    else:
        itemsize = 2
        for scope, prefix in ((cfg, where), (config, "")):
            field = next((k for k in ("torch_dtype", "dtype") if scope.get(k) is not None), None)
            if field is not None:
                itemsize = _itemsize(scope[field], prefix + field)
                break
    layers = _positive_int(cfg, "num_hidden_layers", where)
    if cfg.get("kv_lora_rank") is not None:
        latent = _positive_int(cfg, "kv_lora_rank", where) + _positive_int(cfg, "qk_rope_head_dim", where)
        return layers * latent * itemsize
    heads = _positive_int(cfg, "num_attention_heads", where)
    kv_heads = heads if cfg.get("num_key_value_heads") is None else _positive_int(cfg, "num_key_value_heads", where)
    if cfg.get("head_dim") is not None:
        head_dim = _positive_int(cfg, "head_dim", where)
    else:
        head_dim = _positive_int(cfg, "hidden_size", where) // heads
        if head_dim <= 0:
            raise ValueError(f"{where}hidden_size: smaller than num_attention_heads ({heads})")
    return 2 * layers * kv_heads * head_dim * itemsize


class Gaps(Protocol):
    """Distribution of the seconds between a user's turn and its return."""

    def cdf(self, x: float) -> float:
        """P(G <= x)."""
        ...

    def quantile(self, p: float) -> float:
        """The smallest x with cdf(x) >= p."""
        ...


@dataclass(frozen=True, slots=True)
class LogNormalGaps:
    """Lognormal gaps: human return times spread over orders of magnitude."""

    median_s: float
    sigma: float

    def __post_init__(self) -> None:
        if not (0 < self.median_s < math.inf):
            raise ValueError(f"median_s: expected a positive number, got {self.median_s!r}")
        if not (0 < self.sigma < math.inf):
            raise ValueError(f"sigma: expected a positive number, got {self.sigma!r}")

    def cdf(self, x: float) -> float:
        if x <= 0:
            return 0.0
        if x == math.inf:
            return 1.0
        return NormalDist().cdf(math.log(x / self.median_s) / self.sigma)

    def quantile(self, p: float) -> float:
        if not (0 <= p <= 1):
            raise ValueError(f"p: expected a probability, got {p!r}")
        if p == 0:
            return 0.0
        if p == 1:
            return math.inf
        return self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(p))


@dataclass(frozen=True, slots=True)
class EmpiricalGaps:
    """Gaps measured from a trace; ``samples`` is kept sorted so lookups bisect."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("samples: expected at least one gap")
        for s in self.samples:
            if not s >= 0:  # also NaN
                raise ValueError(f"samples: expected non-negative seconds, got {s!r}")
        object.__setattr__(self, "samples", tuple(sorted(self.samples)))

    def cdf(self, x: float) -> float:
        return bisect_right(self.samples, x) / len(self.samples)

    def quantile(self, p: float) -> float:
        if not (0 <= p <= 1):
            raise ValueError(f"p: expected a probability, got {p!r}")
        if p == 0:
            return 0.0
        n = len(self.samples)
        # the smallest count k with k / n >= p, compared exactly as cdf() divides
        k = bisect_left(range(1, n + 1), p, key=lambda k: k / n)
        return self.samples[k]


def _jsonable(v: float) -> float | str:
    return "inf" if v == math.inf else v


@dataclass(frozen=True, slots=True)
class Plan:
    """What :func:`plan` predicts; ``inputs`` repeats what it was given (and the gaps' median).

    ``windows_s["storage"]`` is 0 and ``inputs`` has no ``l3_tokens`` when there is no L3.
    TTFT savings are against recomputing the prefix and are negative where reading a tier
    is slower than recomputing.
    """

    windows_s: dict[str, float]
    shares: dict[str, float]
    l3_tokens_needed: float
    l3_bytes_needed: float
    ttft_saved_s: dict[str, float]
    expected_ttft_saved_s: float
    inputs: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: infinities (unbounded capacity, window or bandwidth) become ``"inf"``."""
        return {
            "windows_s": {k: _jsonable(v) for k, v in self.windows_s.items()},
            "shares": dict(self.shares),
            "l3_tokens_needed": _jsonable(self.l3_tokens_needed),
            "l3_bytes_needed": _jsonable(self.l3_bytes_needed),
            "ttft_saved_s": dict(self.ttft_saved_s),
            "expected_ttft_saved_s": self.expected_ttft_saved_s,
            "inputs": {k: _jsonable(v) for k, v in self.inputs.items()},
        }


def require(ok: bool, name: str, value: object, what: str) -> None:
    """ValueError naming the argument, what it should be and what it was, unless ``ok``
    (the planner's and the predictor's argument checks)."""
    if not ok:
        raise ValueError(f"{name}: expected {what}, got {value!r}")


def plan(
    *,
    gpu_tokens: float,
    host_tokens: float,
    l3_tokens: float | None,
    insert_rate: float,
    gaps: Gaps,
    bytes_per_token: int,
    prefix_tokens: float,
    recompute_s_per_token: float,
    host_read_bytes_per_s: float,
    l3_read_bytes_per_s: float,
    target_hit_share: float = 0.9,
    tier_rates: Mapping[str, float] | None = None,
) -> Plan:
    """Shares of returning prefixes per tier, the L3 size a target hit share needs, TTFT saved.

    Capacities are tokens (``math.inf``: unbounded; ``l3_tokens=None``: no L3 tier);
    ``insert_rate`` is tokens/s entering the cache (see the module docstring). The L3 size needed is the one
    whose window reaches ``gaps.quantile(target_hit_share)`` (0 when device and host
    already reach the target): L3 holds everything the upper tiers hold, so it needs the
    whole window's tokens, not the rest beyond the host's. ``tier_rates`` (tokens/s placed in
    ``"device"``, ``"host"``, ``"storage"``: computed tokens plus those reloaded into it)
    replaces ``insert_rate`` for the tiers it names: where returning traffic dominates, each
    tier's window is its capacity over its own placement rate.
    """
    require(gpu_tokens >= 0, "gpu_tokens", gpu_tokens, "a non-negative number of tokens")
    require(host_tokens >= 0, "host_tokens", host_tokens, "a non-negative number of tokens")
    require(l3_tokens is None or l3_tokens >= 0, "l3_tokens", l3_tokens, "None or a non-negative number of tokens")
    require(0 < insert_rate < math.inf, "insert_rate", insert_rate, "a positive number of tokens/s")
    require(
        not isinstance(bytes_per_token, bool) and isinstance(bytes_per_token, int) and bytes_per_token > 0,
        "bytes_per_token", bytes_per_token, "a positive integer",
    )
    require(0 <= prefix_tokens < math.inf, "prefix_tokens", prefix_tokens, "a non-negative number")
    require(
        0 <= recompute_s_per_token < math.inf, "recompute_s_per_token", recompute_s_per_token, "a non-negative number",
    )
    require(host_read_bytes_per_s > 0, "host_read_bytes_per_s", host_read_bytes_per_s, "a positive number")
    require(l3_read_bytes_per_s > 0, "l3_read_bytes_per_s", l3_read_bytes_per_s, "a positive number")
    require(0 < target_hit_share < 1, "target_hit_share", target_hit_share, "a share in (0, 1)")

    rates = {t: insert_rate for t in TIERS}
    for tier, rate in (tier_rates or {}).items():
        require(tier in rates, "tier_rates", tier, f"one of {TIERS}")
        require(0 < rate < math.inf, f"tier_rates[{tier}]", rate, "a positive number of tokens/s")
        rates[tier] = rate
    windows = {
        "device": gpu_tokens / rates["device"],
        "host": host_tokens / rates["host"],
        "storage": 0.0 if l3_tokens is None else l3_tokens / rates["storage"],
    }
    reach_host = max(windows["device"], windows["host"])
    cached = [gaps.cdf(windows["device"]), gaps.cdf(reach_host), gaps.cdf(max(reach_host, windows["storage"]))]
    shares = {
        "device": cached[0],
        "host": cached[1] - cached[0],
        "storage": cached[2] - cached[1],
        "miss": 1.0 - cached[2],
    }
    l3_needed = 0.0 if cached[1] >= target_hit_share else rates["storage"] * gaps.quantile(target_hit_share)

    recompute_s = recompute_s_per_token * prefix_tokens
    prefix_bytes = prefix_tokens * bytes_per_token
    saved = {
        "device": recompute_s,
        "host": recompute_s - prefix_bytes / host_read_bytes_per_s,
        "storage": recompute_s - prefix_bytes / l3_read_bytes_per_s,
    }
    inputs = {
        "gpu_tokens": gpu_tokens,
        "host_tokens": host_tokens,
        "insert_rate": insert_rate,
        "gap_median_s": gaps.quantile(0.5),
        "bytes_per_token": bytes_per_token,
        "prefix_tokens": prefix_tokens,
        "recompute_s_per_token": recompute_s_per_token,
        "host_read_bytes_per_s": host_read_bytes_per_s,
        "l3_read_bytes_per_s": l3_read_bytes_per_s,
        "target_hit_share": target_hit_share,
    }
    if l3_tokens is not None:
        inputs["l3_tokens"] = l3_tokens
    for tier, rate in (tier_rates or {}).items():
        inputs[f"{tier}_rate"] = rate
    return Plan(
        windows_s=windows,
        shares=shares,
        l3_tokens_needed=l3_needed,
        l3_bytes_needed=l3_needed * bytes_per_token,
        ttft_saved_s=saved,
        expected_ttft_saved_s=sum(shares[t] * saved[t] for t in TIERS),
        inputs={k: float(v) for k, v in inputs.items()},
    )


def load_gaps(path: str) -> EmpiricalGaps:
    """Gaps from a JSON list of seconds or JSONL lines with a ``gap_s`` field; nulls skipped."""
    text = Path(path).read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list):
        raw = whole
    else:
        raw = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or "gap_s" not in row:
                raise ValueError(f"line {n}: expected an object with a gap_s field")
            raw.append(row["gap_s"])
    gaps = [g for g in raw if g is not None]
    for g in gaps:
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 0:
            raise ValueError(f"expected non-negative seconds, got {g!r}")
    if not gaps:
        raise ValueError("no gaps in the file")
    return EmpiricalGaps(tuple(float(g) for g in gaps))


def _number(*, positive: bool, finite: bool) -> Callable[[str], float]:
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
        if not (v > 0 if positive else v >= 0) or (finite and v == math.inf):
            what = f"{'a positive' if positive else 'a non-negative'}{' finite' if finite else ''} number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v

    return parse


def _share(s: str) -> float:
    v = _number(positive=True, finite=True)(s)
    if v >= 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1), got {s!r}")
    return v


def _bytes_per_token(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _kv_dtype(s: str) -> str:
    if s != "auto":
        try:
            _itemsize(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _parser() -> argparse.ArgumentParser:
    capacity = _number(positive=False, finite=False)  # inf: unbounded
    amount = _number(positive=False, finite=True)
    rate = _number(positive=True, finite=True)
    bandwidth = _number(positive=True, finite=False)
    p = argparse.ArgumentParser(
        prog="python -m sglang_tierstore.tools.plan",
        description="Predict which HiCache tier serves returning prefixes, and size L3 for a target hit share.",
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json, or a directory holding one")
    size.add_argument("--bytes-per-token", type=_bytes_per_token, metavar="N", help="KV bytes per token, all layers")
    p.add_argument("--kv-dtype", type=_kv_dtype, help="KV cache dtype (SGLang --kv-cache-dtype); default: the model's")
    p.add_argument("--gpu-tokens", type=capacity, required=True, help="device KV pool, tokens")
    host = p.add_mutually_exclusive_group(required=True)
    host.add_argument("--host-tokens", type=capacity, help="host KV pool, tokens")
    host.add_argument(
        "--host-gb", type=capacity,
        help="host KV pool, GB of 1e9 bytes holding one copy of the cache "
        "(SGLang --hicache-size; for MHA sharded over TP ranks, that times the TP size)",
    )
    p.add_argument(
        "--l3-gb", type=capacity, help="L3 capacity, GiB (tierstore capacity_gb); omit for no L3, inf: unbounded",
    )
    p.add_argument(
        "--insert-rate", type=rate, required=True, help="tokens/s entering the cache: prefill tokens computed per s",
    )
    p.add_argument("--gap-median", type=rate, metavar="S", help="lognormal return gaps: median seconds")
    p.add_argument("--gap-sigma", type=rate, metavar="X", help="lognormal return gaps: sigma of log(gap)")
    p.add_argument("--gaps-file", metavar="PATH", help="measured gaps: a JSON list of seconds or JSONL with gap_s")
    p.add_argument("--prefix-tokens", type=amount, required=True, help="returning prefix, tokens")
    p.add_argument(
        "--recompute-ms-per-1k-tokens", type=amount, required=True, metavar="MS", help="prefill time per 1000 tokens",
    )
    p.add_argument("--host-gbps", type=bandwidth, required=True, help="host -> device read, GB/s")
    p.add_argument("--l3-gbps", type=bandwidth, required=True, help="L3 -> host read, GB/s")
    p.add_argument("--target-hit-share", type=_share, default=0.9, help="cached share to size L3 for (default 0.9)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _bytes_per_token_arg(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.model_config is None:
        if args.kv_dtype is not None:
            p.error("--kv-dtype applies only with --model-config")
        return int(args.bytes_per_token)
    path = Path(args.model_config)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        p.error(f"--model-config {path}: {e}")
    if not isinstance(config, dict):
        p.error(f"--model-config {path}: expected a JSON object")
    try:
        return kv_bytes_per_token(config, args.kv_dtype)
    except ValueError as e:
        p.error(f"--model-config {path}: {e}")


def _gaps_arg(p: argparse.ArgumentParser, args: argparse.Namespace) -> Gaps:
    lognormal = (args.gap_median, args.gap_sigma)
    if args.gaps_file is not None:
        if lognormal != (None, None):
            p.error("--gaps-file excludes --gap-median/--gap-sigma")
        try:
            return load_gaps(args.gaps_file)
        except (OSError, ValueError) as e:
            p.error(f"--gaps-file {args.gaps_file}: {e}")
    if None in lognormal:
        p.error("give --gap-median and --gap-sigma, or --gaps-file")
    return LogNormalGaps(args.gap_median, args.gap_sigma)


def _seconds(v: float) -> str:
    return "unbounded" if v == math.inf else f"{v:,.1f} s"


def render(result: Plan) -> str:
    """The readable table the CLI prints."""
    has_l3 = "l3_tokens" in result.inputs
    lines = [f"{'tier':<8} {'window':>12} {'share':>9} {'TTFT saved/turn':>16}"]
    for t in TIERS:
        window = _seconds(result.windows_s[t]) if t != "storage" or has_l3 else "no L3"
        lines.append(f"{t:<8} {window:>12} {result.shares[t]:>9.1%} {result.ttft_saved_s[t]:>14.3f} s")
    lines.append(f"{'miss':<8} {'':>12} {result.shares['miss']:>9.1%} {0.0:>14.3f} s")
    lines.append(f"expected TTFT saved per returning turn: {result.expected_ttft_saved_s:.3f} s")
    target = result.inputs["target_hit_share"]
    need = result.l3_tokens_needed
    if need == 0:
        lines.append(f"L3 for {target:.0%} cached: none, device and host reach it")
    elif need == math.inf:
        lines.append(f"L3 for {target:.0%} cached: unbounded (the gaps' quantile is infinite)")
    else:
        gib = result.l3_bytes_needed / GiB
        lines.append(f"L3 for {target:.0%} cached: {need:,.0f} tokens, {gib:,.1f} GiB (capacity_gb)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    bpt = _bytes_per_token_arg(p, args)
    gaps = _gaps_arg(p, args)
    host_tokens = args.host_tokens if args.host_gb is None else args.host_gb * GB / bpt
    result = plan(
        gpu_tokens=args.gpu_tokens,
        host_tokens=host_tokens,
        l3_tokens=None if args.l3_gb is None else args.l3_gb * GiB / bpt,
        insert_rate=args.insert_rate,
        gaps=gaps,
        bytes_per_token=bpt,
        prefix_tokens=args.prefix_tokens,
        recompute_s_per_token=args.recompute_ms_per_1k_tokens / 1e6,
        host_read_bytes_per_s=args.host_gbps * GB,
        l3_read_bytes_per_s=args.l3_gbps * GB,
        target_hit_share=args.target_hit_share,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
