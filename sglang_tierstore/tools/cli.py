"""``tierstore``: look at, check, resize, clear, drop and export a node's store; run its embedded Redis.

Reads the JSON SGLang is given (``--hicache-storage-backend-extra-config``: inline, or a
file ``PATH`` or ``@PATH`` ending in .json, .toml or .yaml) from ``--config`` or
``$TIERSTORE_CONFIG``.

``gc`` lists (and with ``--yes`` removes) store directories under ``path`` that the index
does not hold and where nothing changed for an hour (:mod:`sglang_tierstore.space.orphans`,
which ``stats`` and the exporter count too): on a shared filesystem, or with an external
index, a serving process never removes another store's directory by itself, since its
own index lacking a store proves nothing for the fleet.

``stats``, ``check``, ``clear``, ``drop`` and ``exporter`` look at a store that exists and create
none: directories that are missing or hold no store marker, or an index that does not hold
the store they name, are reported (exit 4) and left alone, and the embedded Redis is joined
only if it is running (``--start-redis`` starts it). Once found, the store is joined as it
is, writing nothing on disk (``TierStore(observe=True)``): the config's ``capacity_gb`` is
not applied to it (``resize`` changes a store's capacity).

Counters of pages read, hit and written live in each serving process (each TP rank): no
index holds them. ``stats`` shows them only when given the server's ``/metrics``
(``--metrics-url``), summed over ranks; ``exporter`` serves index-level gauges only.

Exit codes: 0 done; 1 ``check`` found problems (after ``--fix``: problems it left);
2 bad usage or config (``clear`` or ``drop`` without a terminal to confirm on and without ``--yes``);
3 the index, the embedded Redis, a directory or the metrics URL cannot be reached;
4 no store there; 5 ``clear`` or ``drop`` not confirmed. Passwords are never printed
(:func:`~sglang_tierstore.config.redact_url`).

Imports neither SGLang nor torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.request
from typing import Any, Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from sglang_tierstore.tools import inspect, plan, predict
from sglang_tierstore.config import MAX_CAPACITY_GB, MIN_CAPACITY_GB, TierStoreConfig, describe_target, redact_url
from sglang_tierstore.embedded import (
    embedded_running,
    ensure_embedded_redis,
    pid_file,
    redis_dir,
    socket_path,
    stop_embedded_redis,
)
from sglang_tierstore.errors import AttachBusy, ConfigError, IndexUnavailable, NoStore, TierStoreError
from sglang_tierstore.tools.exporter import run_exporter
from sglang_tierstore.tools.inspect import Opened, index_url, open_store
from sglang_tierstore.perms import check_dirs, modes, remove_created
from sglang_tierstore.space import attach
import sglang_tierstore.space.orphans as orphans
from sglang_tierstore.store import Namespace, open_index

logger = logging.getLogger(__name__)

OK, PROBLEMS, USAGE, UNREACHABLE, NO_STORE, DECLINED = range(6)
CONFIG_ENV = "TIERSTORE_CONFIG"
DROP_WAIT_S = 10.0  # how long `drop` retries while a server holds the attach lock (its expiry, and more)
COUNTER_LABELS = frozenset({"op", "outcome", "kind", "action"})  # kept; others (ranks...) are summed over


class CliError(Exception):
    """What to print, and the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- config -------------------------------------------------------------------------


def load_config(text: Optional[str]) -> TierStoreConfig:
    """The config from inline JSON (any text with a ``{``), or a file named by ``@file``
    or by the text itself (.json, .toml, .yaml, as SGLang reads them)."""
    if not text:
        raise CliError(USAGE, f"no config: give --config '<json>', --config file.json or --config @file.json, "
                              f"or set ${CONFIG_ENV}")
    path = text[1:] if text.startswith("@") else None if "{" in text else text  # JSON is never echoed
    try:
        doc = json.loads(text) if path is None else _config_document(path)
    except (OSError, ValueError, ImportError) as e:
        raise CliError(USAGE, f"--config {'<json>' if path is None else path}: {e}") from None
    if not isinstance(doc, dict):
        raise CliError(USAGE, f"--config: expected a JSON object, got {type(doc).__name__}")
    return TierStoreConfig.from_dict(doc)


def _config_document(path: str) -> Any:
    ext = os.path.splitext(path)[1].lower()
    with open(path, "rb") as f:
        if ext == ".json":
            return json.load(f)
        if ext == ".toml":
            import tomllib

            return tomllib.load(f)
        if ext in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(f)
    raise ValueError(f"unsupported config file extension {ext!r} (expected .json, .toml, .yaml or .yml)")


# -- stats ----------------------------------------------------------------------------


def gather_stats(o: Opened, cfg: TierStoreConfig, counters: Optional[dict[str, float]]) -> dict[str, Any]:
    facts = inspect.index_facts(o.store)
    pages = inspect.pages_by_namespace(o.store)
    g = o.store.space.attached().geometry
    namespaces = [{"id": ns, "page_bytes": pb, "pages": pages.get(ns, 0), "fits": g.holds(pb), "description": desc}
                  for ns, (pb, desc) in sorted(o.store.namespaces().items())]
    return {
        "store": {"id": o.store_id, "prefix": cfg.redis_prefix, "paths": list(cfg.path)},
        "index": {"url": describe_target(o.url), "embedded": o.embedded, "used_memory_bytes": facts.pop("index_memory_bytes")},
        **facts,
        "namespaces": namespaces,
        "counters": counters,
    }


def server_counters(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """tierstore's counters from a server's /metrics, summed over every label but the
    ones that say what was counted (ranks, processes)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            text = r.read().decode()
        families = list(text_string_to_metric_families(text))
    except (OSError, ValueError) as e:
        raise CliError(UNREACHABLE, f"cannot read metrics from {redact_url(url)}: {e}") from None
    out: dict[str, float] = {}
    for fam in families:
        if fam.type != "counter" or not fam.name.startswith("tierstore_"):
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                kept = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k in COUNTER_LABELS)
                key = f"{s.name}{{{kept}}}" if kept else s.name
                out[key] = out.get(key, 0.0) + s.value
    return dict(sorted(out.items()))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(rows: Sequence[Sequence[object]], left: frozenset[int] = frozenset({0})) -> list[str]:
    """Columns padded to their widest cell: ``left`` ones to the left (the last of them, if
    last, not padded: a description), the others (numbers) to the right."""
    cells = [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    last = len(widths) - 1
    return ["  ".join(c if i == last and i in left else c.ljust(w) if i in left else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))) for r in cells]


def render_stats(s: dict[str, Any], cfg: TierStoreConfig, metrics_url: Optional[str]) -> str:
    u = s["usage"]
    memory = s["index"]["used_memory_bytes"]
    capacity = f"{_size(u['capacity_bytes'])}: {u['capacity_regions']} regions of {_size(u['region_bytes'])}"
    if u["capacity_bytes"] != cfg.capacity_bytes:
        capacity += (f" (the config says {_size(cfg.capacity_bytes)}: the store keeps its own; "
                     "`tierstore resize --capacity-gb GB` changes it)")
    lines = _table([
        ["store", f"{s['store']['id']} (prefix {s['store']['prefix']!r}) in {', '.join(s['store']['paths'])}"],
        ["index", f"{s['index']['url']}{' (embedded)' if s['index']['embedded'] else ''}, "
                  f"{_size(memory) + ' of memory' if memory is not None else 'memory not shown (INFO refused)'}"],
        ["capacity", capacity],
        ["allocated", f"{_size(u['allocated_bytes'])} in {u['allocated_regions']} regions"],
        ["regions", f"{u['used_regions']} in use, {u['free_regions']} free, {u['draining_regions']} draining, "
                    f"{u['hole_regions']} holes (no disk space), {u['punch_regions']} to punch out"],
        ["used", f"{_size(s['used_bytes'])} in {u['pages']} pages"],
        ["leases", f"{u['leases']} outstanding, {s['leased_slots']} slots leased"],
        ["page files", u["files"]],
        ["orphans", _orphans(s["orphans"])],
    ], left=frozenset({0, 1}))
    if s["page_sizes"]:
        lines += ["", *_table([["page size", "regions", "pages", "leased", "dead"]] +
                              [[_size(d["page_bytes"]), d["regions"], d["live"], d["leased"], d["dead"]]
                               for d in s["page_sizes"]])]
    if s["namespaces"]:
        lines += ["", *_table([["namespace", "page size", "pages", "description"]] +
                              [[n["id"], _size(n["page_bytes"]), n["pages"], n["description"]] for n in s["namespaces"]],
                              left=frozenset({0, 3}))]
        unfit = [n["id"] for n in s["namespaces"] if not n["fits"]]
        if unfit:
            lines.append(f"pages of {', '.join(unfit)} do not fit the {_size(u['region_bytes'])} regions: never stored "
                         "(give them another redis_prefix, or `tierstore drop` this store while only servers with "
                         "pages this large run)")
    lines.append("")
    if s["counters"] is None:
        lines.append("counters: kept by each serving process, not in the index; --metrics-url "
                     "http://HOST:PORT/metrics reads a server's")
    else:
        lines.append(f"counters from {redact_url(metrics_url or '')}, summed over ranks:")
        counters = [[f"  {k}", f"{v:.0f}" if v.is_integer() else f"{v:g}"] for k, v in s["counters"].items()]
        lines += _table(counters) if counters else ["  (none)"]
    return "\n".join(lines)


def _orphans(o: dict[str, Any]) -> str:
    if not o["dirs"]:
        return "none"
    return (f"{o['dirs']} store director{'y' if o['dirs'] == 1 else 'ies'} no store in the index claims, "
            f"{_size(o['bytes'])} on disk: {', '.join(o['paths'])} (`tierstore gc` removes them)")


# -- commands -------------------------------------------------------------------------


def _stats(args: argparse.Namespace, cfg: TierStoreConfig) -> int:
    counters = server_counters(args.metrics_url) if args.metrics_url else None
    o = open_store(cfg, args.start_redis)
    try:
        s = gather_stats(o, cfg, counters)
    finally:
        o.close()
    print(json.dumps(s, indent=2) if args.json else render_stats(s, cfg, args.metrics_url))
    return OK


def _check(args: argparse.Namespace, cfg: TierStoreConfig) -> int:
    o = open_store(cfg, args.start_redis)
    try:
        verify = not args.no_verify
        problems = inspect.check(o.store, fix=args.fix, verify_pages=verify)
        for p in problems:
            print(p)
        if args.fix and problems:
            found, problems = len(problems), inspect.check(o.store, fix=False, verify_pages=verify)
            print(f"{found} problem(s) found and fixed where possible; {len(problems)} remain")
            for p in problems:
                print(f"remains: {p}")
    finally:
        o.close()
    print(f"store {o.store_id}: {len(problems)} problem(s)" if problems else f"store {o.store_id}: no problems")
    return PROBLEMS if problems else OK


def _resize(args: argparse.Namespace, cfg: TierStoreConfig) -> int:
    if args.capacity_gb != 0 and not MIN_CAPACITY_GB <= args.capacity_gb <= MAX_CAPACITY_GB:
        raise CliError(USAGE, f"--capacity-gb: expected 0 (hold nothing) or {MIN_CAPACITY_GB:g} to "
                              f"{MAX_CAPACITY_GB:g}, got {args.capacity_gb:g}")
    o = open_store(cfg, args.start_redis)
    try:
        old = o.store.space.attached().capacity
        new = int(args.capacity_gb * (1 << 30))
        try:
            o.store.space.set_capacity(new)
        except ValueError as e:
            raise CliError(USAGE, f"--capacity-gb {args.capacity_gb:g}: {e}") from None
    finally:
        o.close()
    print(f"store {o.store_id}: capacity {_size(old)} -> {_size(new)}"
          + (" (every process evicts down to it and returns the disk space)" if new < old else ""))
    return OK


def _gc(args: argparse.Namespace, cfg: TierStoreConfig) -> int:
    """Store directories under the config's paths that the config's index does not hold, and
    where nothing changed for ``--min-age-s``: listed, and removed with ``--yes``."""
    idx = open_index(cfg, index_url(cfg, args.start_redis)[0])
    try:
        found = [o for o in orphans.find(idx, cfg.redis_prefix, cfg.path) if o.newest < time.time() - args.min_age_s]
    except IndexUnavailable as e:
        raise CliError(UNREACHABLE, f"cannot reach the index at {describe_target(index_url(cfg, False)[0])}: {e}") from None
    finally:
        idx.close()
    for o in found:
        if args.yes:
            orphans.remove(o)
        print(f"{'removed' if args.yes else 'would remove'} {o.path} (store {o.store_id}, {_size(o.disk_bytes)} on disk: "
              "the index holds nothing for it)")
    if not found:
        print("nothing to remove: every store directory here is held by the index, or changed recently")
    elif not args.yes:
        print("run again with --yes to remove them (only against the index every node of these directories uses)")
    return OK


def _confirm(command: str, question: str) -> bool:
    if not sys.stdin.isatty():
        raise CliError(USAGE, f"{command} asks before it deletes, and there is no terminal to ask on: pass --yes")
    try:
        answer = input(f"{question} [y/N] ")
    except (EOFError, KeyboardInterrupt):  # no answer is a no
        print()
        return False
    return answer.strip().lower() in ("y", "yes")


def _clear(args: argparse.Namespace, cfg: TierStoreConfig) -> int:
    o = open_store(cfg, args.start_redis)
    try:
        known = o.store.namespaces()
        chosen = sorted(set(args.namespace or known))
        unknown = [ns for ns in chosen if ns not in known]
        if unknown:
            raise CliError(USAGE, f"unknown namespace(s) {', '.join(unknown)}; store {o.store_id} has: "
                                  f"{', '.join(sorted(known)) or 'none'}")
        if not chosen:
            print(f"store {o.store_id} has no namespaces: nothing to clear")
            return OK
        pages = inspect.pages_by_namespace(o.store)
        what = "every namespace" if not args.namespace else f"namespace(s) {', '.join(chosen)}"
        question = (f"Drop {sum(pages.get(ns, 0) for ns in chosen)} pages of {what} from store {o.store_id} "
                    f"under {', '.join(cfg.path)}?")
        if not args.yes and not _confirm("clear", question):
            print("nothing dropped")
            return DECLINED
        dropped = o.store.clear([Namespace(ns, bytes.fromhex(ns), *known[ns]) for ns in chosen])
    finally:
        o.close()
    print(f"dropped {dropped} pages of {what}")
    return OK


def _drop(args: argparse.Namespace, cfg: TierStoreConfig) -> int:
    """The whole store: what re-cuts its regions (for pages larger than them) is a new store."""
    o = open_store(cfg, args.start_redis)
    try:
        question = (f"Drop store {o.store_id} (every page, its index keys and its directories under "
                    f"{', '.join(cfg.path)})?")
        if not args.yes and not _confirm("drop", question):
            print("nothing dropped")
            return DECLINED
        deadline = time.monotonic() + DROP_WAIT_S
        while True:  # a server attaching holds the attach lock for a moment (or, dead, for its expiry)
            try:
                attach.drop(o.store.index, cfg.redis_prefix, cfg.path, o.store_id, cfg.node_name)
                break
            except AttachBusy:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        o.close()
    print(f"dropped store {o.store_id}: the next server to attach creates a new one, its regions cut for its own pages")
    return OK


def _redis(args: argparse.Namespace, cfg: TierStoreConfig) -> int:
    if cfg.index_target is not None:
        raise CliError(USAGE, f"the config names an index ({describe_target(cfg.index_target)}): `tierstore redis` "
                              "runs only the embedded Redis, used when redis_url, redis_cluster and redis_sentinel "
                              "are unset")
    path = cfg.path[0]
    if args.action == "start":
        created = check_dirs(cfg.path[:1], modes(cfg.file_access))
        try:
            started = ensure_embedded_redis(path, modes(cfg.file_access), cfg.redis_server).started
        except BaseException:  # a failed start leaves nothing behind
            remove_created(created)
            raise
        print(f"embedded Redis of {path}: {'started' if started else 'already running'}")
    elif args.action == "stop":
        running = embedded_running(path)
        stop_embedded_redis(path)
        print(f"embedded Redis of {path}: {'stopped' if running else 'not running'}")
        return OK
    return _redis_status(cfg, args.json)


def _redis_status(cfg: TierStoreConfig, as_json: bool) -> int:
    path = cfg.path[0]
    status: dict[str, Any] = {"path": path, "running": embedded_running(path), "socket": socket_path(path),
                              "log": os.path.join(redis_dir(path), "redis.log")}
    if status["running"]:
        status["pid"] = _pid(path)
        idx = open_index(cfg, index_url(cfg, False)[0])
        try:
            status["used_memory_bytes"] = idx.memory_used()
        except IndexUnavailable as e:
            raise CliError(UNREACHABLE, f"the embedded Redis of {path} does not answer: {e}") from None
        finally:
            idx.close()
    if as_json:
        print(json.dumps(status, indent=2))
    else:
        rows = [["embedded Redis", f"{path}: {'running' if status['running'] else 'not running'}"]]
        if status["running"]:
            rows += [["pid", status["pid"]], ["memory", _size(status["used_memory_bytes"]) + " used"]]
        rows += [["socket", status["socket"]], ["log", status["log"]]]
        print("\n".join(_table(rows, left=frozenset({0, 1}))))
    return OK if status["running"] else UNREACHABLE


def _pid(path: str) -> Optional[int]:
    try:
        with open(pid_file(path)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _exporter(args: argparse.Namespace, cfg: TierStoreConfig) -> int:
    run_exporter(cfg, args.port, args.addr, args.interval, args.start_redis)
    return OK


# -- arguments ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierstore",
        description="Look at, check, resize, clear, drop and export a node's tierstore; run its embedded Redis. "
                    "Exit codes: 0 done, 1 problems found, 2 bad usage or config, 3 index, Redis, directory or "
                    "metrics URL unreachable, 4 no store there, 5 clear or drop not confirmed.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=os.environ.get(CONFIG_ENV),
                        help=f"the JSON given to SGLang's --hicache-storage-backend-extra-config, inline, or a file "
                             f"(PATH or @PATH: .json, .toml, .yaml); default ${CONFIG_ENV}")
    joins = argparse.ArgumentParser(add_help=False, parents=[common])
    joins.add_argument("--start-redis", action="store_true",
                       help="start the embedded Redis if it is not running (default: report it and stop)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("stats", parents=[joins], help="capacity, usage, page sizes, namespaces, Redis memory")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--metrics-url", metavar="URL", help="a server's /metrics, to show its tierstore counters")
    s.set_defaults(run=_stats)

    c = sub.add_parser("check", parents=[joins], help="compare the index with itself and the page files")
    c.add_argument("--fix", action="store_true", help="drop entries that do not verify, then check again")
    c.add_argument("--no-verify", action="store_true", help="do not read pages to compare their checksums")
    c.set_defaults(run=_check)

    rs = sub.add_parser("resize", parents=[joins], help="change the store's capacity (every process follows)")
    rs.add_argument("--capacity-gb", type=float, required=True, metavar="GB", help="the new capacity in GiB (0: hold nothing)")
    rs.set_defaults(run=_resize)

    cl = sub.add_parser("clear", parents=[joins], help="drop the pages of some namespaces, or of all")
    cl.add_argument("--namespace", action="append", metavar="ID", help="a namespace id (from stats); repeatable")
    cl.add_argument("--yes", action="store_true", help="do not ask (needed without a terminal)")
    cl.set_defaults(run=_clear)

    d = sub.add_parser("drop", parents=[joins], help="drop the whole store (the next server creates a new one)")
    d.add_argument("--yes", action="store_true", help="do not ask (needed without a terminal)")
    d.set_defaults(run=_drop)

    g = sub.add_parser("gc", parents=[joins], help="remove store directories no store in the index claims")
    g.add_argument("--min-age-s", type=float, default=3600.0, metavar="S",
                   help="leave directories where anything changed within S seconds (default 3600)")
    g.add_argument("--yes", action="store_true", help="remove them (default: list them)")
    g.set_defaults(run=_gc)

    r = sub.add_parser("redis", parents=[common], help="start, stop or show the embedded Redis")
    r.add_argument("action", choices=("start", "stop", "status"))
    r.add_argument("--json", action="store_true", help="status as JSON")
    r.set_defaults(run=_redis)

    sub.add_parser("plan", add_help=False, help="the residency planner (tierstore plan --help)")
    sub.add_parser("predict", add_help=False, help="residency before the run, from the workload (tierstore predict --help)")

    e = sub.add_parser("exporter", parents=[joins], help="serve index-level gauges for Prometheus")
    e.add_argument("--port", type=int, required=True, help="port to serve /metrics on")
    e.add_argument("--addr", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this host only; the gauges name the store's "
                        "page sizes, namespaces and usage, so expose them deliberately, e.g. --addr 0.0.0.0)")
    e.add_argument("--interval", type=float, default=0.0, metavar="S",
                   help="read the index at most once per S seconds, whatever the scrape rate (default: every scrape)")
    e.set_defaults(run=_exporter)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["plan"]:
        return plan.main(args_in[1:])
    if args_in[:1] == ["predict"]:
        return predict.main(args_in[1:])
    args = _parser().parse_args(args_in)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        cfg = load_config(args.config)
        return int(args.run(args, cfg))
    except CliError as e:
        return _fail(e.code, str(e))
    except ConfigError as e:
        return _fail(USAGE, str(e))
    except NoStore as e:
        return _fail(NO_STORE, str(e))
    except (TierStoreError, OSError) as e:
        return _fail(UNREACHABLE, str(e))


def _fail(code: int, message: str) -> int:
    print(f"tierstore: {message.removeprefix('tierstore: ').removeprefix('tierstore ')}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
