"""The ``aoti-eager`` command line (also ``python -m aoti_eager``).

Exit codes: 0 success, 1 problems found (``cache verify``, ``doctor``, an entry
``prewarm`` could not compile) or a failure, 2 a usage error. A failure is one
line on stderr (with ``--json``, an object with an ``error`` field on stdout);
``--debug`` shows its traceback instead.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from aoti_eager import settings
from aoti_eager.cache import bundle, default_root, inventory, remote, signing, store
from aoti_eager.version import __version__

_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _size(text: str) -> int:
    try:
        return settings.parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {settings.SIZE.expected}") from None


def _duration(text: str) -> float:
    """A duration in seconds: a number with a unit of ``s``, ``m``, ``h``, ``d`` or
    ``w`` (``"30d"``, ``"12h"``, ``"90m"``), or a bare number of seconds (``"3600"``)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw]?)", text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30d, 12h, 90m, 3600)")
    return float(match[1]) * _DURATION_UNITS[match[2]]


def _op(text: str) -> str:
    """``add``, ``add.Tensor``: aten ops may be named without ``aten::``."""
    return text if "::" in text else f"aten::{text}"


def _human(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _listing_json(listing: inventory.Listing) -> dict[str, Any]:
    from aoti_eager.kernels.dynamic import NotDynamic, ShapeFamily
    from aoti_eager.kernels.signature import short_form

    meta = listing.metadata()
    try:
        # A dynamic-shape kernel shows its symbols where its sizes move.
        dynamic = meta.get("dynamic")
        signature = ShapeFamily.from_json(dynamic).short(meta["signature"]) if dynamic else short_form(meta["signature"])
    except NotDynamic as e:
        signature = f"{short_form(meta['signature'])} (unused: {e})"
    except (KeyError, TypeError, ValueError):
        signature = "(unreadable entry.json)"
    return {
        "op": listing.op,
        "device": listing.device,
        "environment": listing.environment,
        "key": listing.directory.name,
        "signature": signature,
        "dynamic": meta.get("dynamic"),
        "bytes": listing.bytes,
        "compile_seconds": meta.get("compile_seconds"),
        "last_use": listing.last_use,
        "eager_reason": meta.get("reason") if meta.get("library") is None else None,
        # The kernel's time against eager's, measured when it was compiled (see AOTI_EAGER_KEEP_FASTER).
        "timing": meta.get("timing"),
        "kept_eager_as_faster": meta.get("library") is None and meta.get("timing") is not None,
    }


def cache_list(root: Path, args: argparse.Namespace) -> int:
    rows = [_listing_json(listing) for listing in inventory.entries(root, args.op)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    by_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_op[row["op"]].append(row)
    for op in sorted(by_op):
        total = sum(row["bytes"] for row in by_op[op])
        print(f"{op}: {len(by_op[op])} entries, {_human(total)}")
        for row in by_op[op]:
            what = f"eager: {row['eager_reason']}" if row["eager_reason"] else f"compiled in {row['compile_seconds']} s"
            if row["timing"]:
                what += f" (kernel {row['timing']['kernel_us']:.1f} us, eager {row['timing']['eager_us']:.1f} us)"
            print(f"  {row['device']:<4} ({row['signature']})  {_human(row['bytes'])}  {what}  last used {_when(row['last_use'])}")
    if not rows:
        print(f"no entries in {root}")
    return 0


def cache_stats(root: Path, args: argparse.Namespace) -> int:
    listed = inventory.entries(root)
    abandoned = list(inventory.abandoned_temporaries(root))
    by_op: dict[str, dict[str, int]] = defaultdict(lambda: {"entries": 0, "bytes": 0, "kept_eager_as_faster": 0})
    by_device: dict[str, dict[str, int]] = defaultdict(lambda: {"entries": 0, "bytes": 0, "kept_eager_as_faster": 0})
    for listing in listed:
        meta = listing.metadata()
        faster = meta.get("library") is None and meta.get("timing") is not None
        for row in (by_op[listing.op], by_device[listing.device]):
            row["entries"] += 1
            row["bytes"] += listing.bytes
            row["kept_eager_as_faster"] += faster
    stats = {
        "path": str(root),
        "entries": len(listed),
        "bytes": sum(listing.bytes for listing in listed),
        "size_limit": settings.cache_size.get(),
        "quarantined": len(inventory.quarantined(root)),
        # Temporary directories of processes killed while compiling or publishing.
        "abandoned": len(abandoned),
        "abandoned_bytes": sum(inventory.tree_bytes(path) for path in abandoned),
        # Signatures where eager was measured faster than their kernel.
        "kept_eager_as_faster": sum(row["kept_eager_as_faster"] for row in by_device.values()),
        "by_op": dict(sorted(by_op.items())),
        "by_device": dict(sorted(by_device.items())),
    }
    if args.json:
        print(json.dumps(stats, indent=1))
        return 0
    print(f"{root}: {stats['entries']} entries, {_human(stats['bytes'])} of {_human(stats['size_limit'])}, "
          f"{stats['quarantined']} quarantined, {stats['kept_eager_as_faster']} kept eager as faster than their kernel, "
          f"{stats['abandoned']} abandoned temporary directories ({_human(stats['abandoned_bytes'])})")
    for title, rows in (("by op", stats["by_op"]), ("by device", stats["by_device"])):
        if rows:
            print(title + ":")
            for name, row in rows.items():
                faster = f", {row['kept_eager_as_faster']} kept eager as faster" if row["kept_eager_as_faster"] else ""
                print(f"  {name}: {row['entries']} entries, {_human(row['bytes'])}{faster}")
    return 0


def cache_verify(root: Path, args: argparse.Namespace) -> int:
    checked = len(inventory.entries(root))
    problems = inventory.verify(root, quarantine=args.quarantine)
    if args.json:
        bad = [{"entry": str(bad.path), "op": bad.op, "problem": bad.problem} for bad in problems]
        print(json.dumps({"checked": checked, "bad": bad, "quarantined": args.quarantine}, indent=1))
    else:
        for bad in problems:
            print(f"BAD {bad.path}: {bad.problem}")
        moved = " (moved to the quarantine)" if args.quarantine and problems else ""
        print(f"{checked} entries checked, {len(problems)} bad{moved}")
    return 1 if problems else 0


def _report_eviction(eviction: inventory.Eviction, args: argparse.Namespace, **extra: Any) -> int:
    removed_bytes = sum(listing.bytes for listing in eviction.removed)
    if args.json:
        print(json.dumps({
            "removed": len(eviction.removed),
            "removed_bytes": removed_bytes,
            "in_use": [str(listing.directory) for listing in eviction.in_use],
            "links_removed": [str(link) for link in eviction.links_removed],
            **extra,
        }, indent=1))
        return 0
    print(f"removed {len(eviction.removed)} entries ({_human(removed_bytes)})")
    if extra.get("old_layouts_removed"):
        print(f"removed {extra['old_layouts_removed']} directories of an earlier cache layout")
    for link in eviction.links_removed:
        print(f"removed the symbolic link {link} (not part of the cache; what it points to is untouched)")
    for listing in eviction.in_use:
        print(f"kept {listing.directory}: a process is loading it")
    return 0


def cache_prune(root: Path, args: argparse.Namespace) -> int:
    max_size = args.max_size if args.max_size is not None else settings.cache_size.get()
    eviction = inventory.evict(root, max_bytes=max_size, older_than=args.older_than)
    return _report_eviction(eviction, args, old_layouts_removed=inventory.remove_old_layouts(root))


def cache_clear(root: Path, args: argparse.Namespace) -> int:
    eviction = inventory.evict(root, max_bytes=0, op=args.op)
    quarantined = 0 if args.op else inventory.clear_quarantine(root)
    old_layouts = 0 if args.op else inventory.remove_old_layouts(root)
    abandoned = 0
    for path in inventory.abandoned_temporaries(root, args.op):
        store.remove_tree(root, path)
        abandoned += 1
    if not args.op:
        from aoti_eager.kernels.inductor.load_probe import forget_verdicts

        forget_verdicts()
    if not args.json and quarantined:
        print(f"removed {quarantined} quarantined entries")
    if not args.json and abandoned:
        print(f"removed {abandoned} temporary directories left by processes killed while publishing")
    return _report_eviction(
        eviction, args, quarantined_removed=quarantined, abandoned_removed=abandoned, old_layouts_removed=old_layouts
    )


def _report_transfer(transfer: Any, verb: str, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps({
            verb: transfer.done,
            "signed_by": transfer.signed_by,
            "already_present": transfer.already_present,
            "skipped": [{"entry": name, "reason": reason} for name, reason in transfer.skipped],
        }, indent=1))
        return
    for name, reason in transfer.skipped:
        print(f"skipped {name}: {reason}")
    present = f", {len(transfer.already_present)} already present" if transfer.already_present else ""
    print(f"{verb} {len(transfer.done)} entries{present}, skipped {len(transfer.skipped)}")


def cache_keygen(root: Path, args: argparse.Namespace) -> int:
    key = signing.generate_key_pair(args.file)
    public = signing.public_key_path(args.file)
    if args.json:
        print(json.dumps({"private_key": str(args.file), "public_key": str(public), "fingerprint": key}, indent=1))
    else:
        print(f"private key {args.file} (keep it with whoever builds bundles: export --sign-key or ${settings.signing_key.name})")
        print(f"public key  {public} ({key}): ship it, and trust it with import --trust-key "
              f"or ${settings.trusted_keys.name}")
    return 0


def cache_export(root: Path, args: argparse.Namespace) -> int:
    transfer = bundle.export_bundle(root, args.file, args.sign_key or settings.signing_key.get())
    if transfer.signed_by is None:
        print(f"aoti-eager: warning: {args.file} is not signed (no --sign-key, no ${settings.signing_key.name}): "
              "it imports only with --allow-unsigned", file=sys.stderr)
    _report_transfer(transfer, "exported", args)
    return 0


def _environments_here() -> list[str]:
    """The names of this machine's cache environments (its CPU's, and its GPU's)."""
    import torch

    from aoti_eager.kernels.compile import compile_options
    from aoti_eager.kernels.toolchain import environment_name

    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return [environment_name(torch.device(d), compile_options(d)) for d in devices]


def cache_import(root: Path, args: argparse.Namespace) -> int:
    here = _environments_here()
    transfer = bundle.import_bundle(root, args.file, here, args.trust_key + settings.trusted_keys.get(), args.allow_unsigned)
    if transfer.untrusted_because:
        print(f"aoti-eager: warning: imported {args.file} without a trusted signature ({transfer.untrusted_because}): "
              "its kernels are native code that will run in this user's processes", file=sys.stderr)
    _report_transfer(transfer, "imported", args)
    return 0


def _fleet_server(args: argparse.Namespace) -> remote.Server:
    """The fleet cache's server (--url, else $AOTI_EAGER_REMOTE), checked to answer."""
    url = args.url or settings.remote.get()
    if url is None:
        raise ValueError(f"no fleet cache: set ${settings.remote.name}=redis://host:port/db or pass --url")
    server = remote.server(settings.URL.parse(url))
    server.call("PING")
    return server


def remote_stats(root: Path, args: argparse.Namespace) -> int:
    server = _fleet_server(args)
    by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    environments: set[str] = set()
    for entry in remote.entries(server):
        by_op[entry.op][0] += 1
        by_op[entry.op][1] += entry.bytes
        environments.add(entry.environment)
    total = [sum(n for n, _ in by_op.values()), sum(b for _, b in by_op.values())]
    if args.json:
        print(json.dumps({"server": remote.redacted(server.url), "entries": total[0], "bytes": total[1],
                          "environments": sorted(environments),
                          "by_op": {op: {"entries": n, "bytes": b} for op, (n, b) in sorted(by_op.items())}}, indent=1))
        return 0
    print(f"{remote.redacted(server.url)}: {total[0]} entries, {_human(total[1])}, {len(environments)} environments")
    for op, (n, b) in sorted(by_op.items()):
        print(f"  {op:40} {n:6} entries  {_human(b):>10}")
    return 0


def remote_push(root: Path, args: argparse.Namespace) -> int:
    server = _fleet_server(args)
    if settings.signing_key.get() is None:
        raise ValueError(f"nothing to push with: only signed entries are shared, and ${settings.signing_key.name} is "
                         "unset (`aoti-eager cache keygen KEY`, then set it to KEY)")
    transfer = bundle.Transfer()
    for listing in inventory.entries(root):
        name = "/".join(listing.directory.parts[-3:])
        try:
            if store.read_entry(listing.directory, root) is None:
                continue  # removed meanwhile
        except (store.DamagedEntry, store.UntrustedEntry) as e:
            transfer.skipped.append((name, str(e)))
            continue
        tier = remote.RedisTier(server, listing.environment)
        published = tier.offer(listing.op, listing.directory.name, listing.directory)
        server.call("PING")  # a failure of the offer is the server's: say so
        (transfer.done if published else transfer.already_present).append(name)
    _report_transfer(transfer, "pushed", args)
    return 0


def remote_pull(root: Path, args: argparse.Namespace) -> int:
    server = _fleet_server(args)
    here = set(_environments_here())
    transfer = bundle.Transfer()
    for found in remote.entries(server, op=args.op):
        name = f"{found.environment}/{store.op_dirname(found.op)}/{found.signature_key}"
        if found.environment not in here:
            transfer.skipped.append((name, "built for another environment (torch, compiler, CPU or GPU)"))
            continue
        cache = store.KernelCache(root, found.environment)
        if cache.lookup(found.op, found.signature_key) is not None:
            transfer.already_present.append(name)
            continue
        cache.behind = remote.RedisTier(server, found.environment)
        with cache.lock_signature(found.op, found.signature_key):
            pulled = cache.lookup(found.op, found.signature_key)
        if pulled is None:
            transfer.skipped.append((name, "refused: see the warning above (unsigned, untrusted or altered)"))
        else:
            transfer.done.append(name)
    _report_transfer(transfer, "pulled", args)
    return 1 if any(why.startswith("refused") for _, why in transfer.skipped) else 0


def _remote_report() -> tuple[dict[str, Any], list[str]]:
    """Whether the fleet cache answers, and the keys that sign and are trusted."""
    url = settings.remote.get()
    report: dict[str, Any] = {"url": remote.redacted(url) if url else None}
    problems = []
    keys = [("signing_key", settings.signing_key.get(), True)] + [("trusted", k, False) for k in settings.trusted_keys.get()]
    report["trusted_keys"] = []
    for kind, path, private in keys:
        if path is None:
            report[kind] = None
            continue
        try:
            described = {"path": str(path), "fingerprint": signing.key_file_fingerprint(path, private)}
        except signing.KeyFileError as e:
            described = {"path": str(path), "error": str(e)}
            problems.append(str(e))
        if private:
            report[kind] = described
        else:
            report["trusted_keys"].append(described)
    if url is not None:
        started = time.perf_counter()
        try:
            remote.server(url).call("PING")
            report["reachable"], report["ping_ms"] = True, round((time.perf_counter() - started) * 1000, 2)
        except remote.ServerUnavailable as e:
            report["reachable"], report["error"] = False, str(e)
            problems.append(str(e))
        if not report["trusted_keys"]:
            problems.append(f"the fleet cache is set but no key is trusted (${settings.trusted_keys.name}): "
                            "its entries are never used")
    return report, problems


def _remote_line(report: dict[str, Any]) -> str:
    if report["url"] is None:
        return f"none (${settings.remote.name} unset)"
    reach = f"answers in {report['ping_ms']} ms" if report["reachable"] else f"does not answer ({report['error']})"
    signing_key = report["signing_key"] or {"fingerprint": "nothing (no signing key)"}
    signs = signing_key.get("fingerprint", signing_key.get("error"))
    trusted = ", ".join(k.get("fingerprint", k.get("error", "?")) for k in report["trusted_keys"]) or "none"
    return f"{report['url']} {reach}; publishes signed by {signs}; trusts {trusted}"


def prewarm_command(root: Path, args: argparse.Namespace) -> int:
    from aoti_eager._prewarm import prewarm, summary

    try:
        report = prewarm(args.manifest, jobs=args.jobs, devices=args.devices, cache_dir=root,
                         output=None if args.json else sys.stdout)
    except KeyboardInterrupt:
        print("\ninterrupted: compiled entries are in the cache; run the same command again to compile the rest",
              file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps({
            "seconds": round(report.seconds, 3),
            "results": [{"op": r.entry.op, "device": r.entry.device, "key": r.entry.key, **vars(r.outcome)}
                        for r in report.results],
            "skipped": len(report.skipped),
            "skipped_regions": [{"region": s.entry.region, "key": s.entry.key, "reason": s.reason}
                                for s in report.skipped_regions],
        }, indent=1))
    else:
        print(summary(report))
    return 1 if report.failed else 0


def _cache_directory_report(root: Path) -> tuple[dict[str, Any], list[str]]:
    from aoti_eager.cache.store import UntrustedEntry, check_trusted

    report: dict[str, Any] = {"path": str(root), "exists": root.exists()}
    problems = []
    if root.exists():
        st = root.stat()
        report.update(mode=f"{st.st_mode & 0o7777:o}", owner_uid=st.st_uid, group_gid=st.st_gid)
        try:
            check_trusted(root, root)
        except UntrustedEntry as e:
            problems.append(f"cache directory: {e}; nothing in it will be loaded")
    return report, problems


def _load_probe_report() -> tuple[dict[str, str | None], list[str]]:
    """Per cache environment judged on this machine, why its kernels are not loaded (None: they load)."""
    from aoti_eager.kernels.inductor.load_probe import recorded_verdicts

    verdicts = recorded_verdicts()
    return verdicts, [f"kernels of {env} run eagerly: {reason}" for env, reason in verdicts.items() if reason]


def _load_probe_line(verdicts: dict[str, str | None]) -> str:
    return "; ".join(f"{env}: {'loads' if reason is None else 'crashes: ' + reason}" for env, reason in verdicts.items()) or "none yet"


def _settings_report() -> dict[str, dict[str, Any]]:
    """Every setting as written (None: unset), and whether the environment set
    it; each is parsed, so that a bad value fails here, naming it."""
    for setting in settings.ALL:
        setting.get()
    return {setting.name: {"value": setting.text() or None, "set": setting.is_set()} for setting in settings.ALL}


def doctor(root: Path, args: argparse.Namespace) -> int:
    import torch

    from aoti_eager import _extension, _selfcheck
    from aoti_eager.kernels import toolchain

    problems: list[str] = []
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_git": str(torch.version.git_version),
        "compiler": toolchain.compiler_identity(toolchain.cpp_compiler()),
        "cpu_isa": toolchain.cpu_isa(),
        "cuda": {"available": torch.cuda.is_available(), "version": torch.version.cuda, "devices": []},
    }
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            report["cuda"]["devices"].append({"index": index, "name": torch.cuda.get_device_name(index), "arch": f"sm_{major}{minor}"})
    report["cache"], cache_problems = _cache_directory_report(root)
    problems += cache_problems
    report["load_probe"], load_problems = _load_probe_report()
    problems += load_problems
    report["settings"] = _settings_report()
    report["remote"], remote_problems = _remote_report()
    problems += remote_problems
    try:
        _extension.load()
        report["extension"] = {"loads": True, "directory": str(_extension.build_directory())}
    except Exception as e:  # noqa: BLE001 - reported, with exit code 1
        report["extension"] = {"loads": False, "error": f"{type(e).__name__}: {e}"}
        problems.append(f"the C++ extension does not build or load: {type(e).__name__}: {e}")
    report["kernels"] = []
    if report["extension"]["loads"]:
        for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
            check = _selfcheck.check_device(device)
            report["kernels"].append(check.to_json())
            if check.failed_stage:
                problems.append(f"a {device} kernel fails at the {check.failed_stage} stage: {check.reason}")
    report["problems"] = problems
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        devices = ", ".join(f"cuda:{d['index']} {d['name']} ({d['arch']})" for d in report["cuda"]["devices"]) or "none"
        cache = report["cache"]
        permissions = f"mode {cache['mode']}, uid {cache['owner_uid']}" if cache["exists"] else "not created yet"
        print(f"python     {report['python']} on {report['platform']}")
        print(f"torch      {report['torch']} ({report['torch_git']})")
        print(f"compiler   {report['compiler']}")
        print(f"cpu isa    {report['cpu_isa']}")
        print(f"cuda       {report['cuda']['version'] or 'none'}; devices: {devices}")
        print(f"cache      {cache['path']} ({permissions})")
        print(f"extension  {'builds and loads' if report['extension']['loads'] else report['extension']['error']}")
        print(f"load probe {_load_probe_line(report['load_probe'])}")
        print(f"fleet      {_remote_line(report['remote'])}")
        for check in report["kernels"]:
            verdict = f"FAILED at the {check['failed_stage']} stage" if check["failed_stage"] else "compiled, loaded, ran: eager's result"
            print(f"kernel     {check['device']}: abs {verdict} ({check['seconds']:.1f} s to the first result)")
        for name, setting in report["settings"].items():
            value = "unset" if setting["value"] is None else f"= {setting['value']}"
            print(f"setting    {name} {value} ({'set' if setting['set'] else 'default'})")
        for problem in problems:
            print(f"PROBLEM: {problem}")
    return 1 if problems else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aoti-eager", description="Eager PyTorch with AOTInductor kernels.")
    parser.add_argument("--version", action="version", version=f"aoti_eager {__version__}")
    parser.add_argument("--cache-dir", type=Path, help="the cache (default: $AOTI_EAGER_CACHE_DIR, else the per-user cache dir)")
    parser.add_argument("--debug", action="store_true",
                        help="on a failure, raise with its traceback instead of one line on stderr (to report a bug)")
    json_output = argparse.ArgumentParser(add_help=False)
    json_output.add_argument("--json", action="store_true", help="print JSON")
    commands = parser.add_subparsers(dest="command", required=True)
    cache = commands.add_parser("cache", help="the persistent kernel cache").add_subparsers(dest="action", required=True)

    def command(parent, name: str, run, help: str) -> argparse.ArgumentParser:
        sub = parent.add_parser(name, help=help, parents=[json_output])
        sub.set_defaults(run=run)
        return sub

    command(cache, "path", lambda root, args: print(json.dumps(str(root)) if args.json else root),
            "print the cache directory ($AOTI_EAGER_CACHE_DIR or the per-user cache dir)")
    listing = command(cache, "list", cache_list, "entries per op: signature, size, compile time, last use")
    listing.add_argument("--op", type=_op, help="only this op (aten::add or add: all its overloads)")
    command(cache, "stats", cache_stats, "entries and bytes, by op and by device")
    verify = command(cache, "verify", cache_verify, "re-hash every entry; exit code 1 if any is bad")
    verify.add_argument("--quarantine", action="store_true", help="move bad entries to the quarantine")
    prune = command(cache, "prune", cache_prune, "evict least recently used entries (entries being loaded stay)")
    prune.add_argument("--max-size", type=_size, help="keep at most this much, e.g. 5GiB (default: the size limit)")
    prune.add_argument("--older-than", type=_duration, help="also evict entries unused for this long, e.g. 30d")
    clear = command(cache, "clear", cache_clear, "remove every entry (and the quarantine, earlier layouts' directories, "
                    "and what processes killed while publishing left)")
    clear.add_argument("--op", type=_op, help="only this op's entries (aten::add or add: all its overloads)")
    keygen = command(cache, "keygen", cache_keygen, "write a new ed25519 key pair to sign bundles: FILE (private) and FILE.pub")
    keygen.add_argument("file", type=Path)
    export = command(cache, "export", cache_export, "write every entry, with its key and checksum, into a signed bundle (tar)")
    export.add_argument("file", type=Path)
    export.add_argument("--sign-key", type=Path, help=f"the private key to sign with (default: ${settings.signing_key.name})")
    imports = command(cache, "import", cache_import, "install a bundle's entries that fit this machine "
                      "(signature and checksums verified); report the rest")
    imports.add_argument("file", type=Path)
    imports.add_argument("--trust-key", type=Path, action="append", default=[], metavar="KEY.pub",
                         help=f"a public key whose bundles are trusted (repeatable; also ${settings.trusted_keys.name}, "
                              "paths separated by ':')")
    imports.add_argument("--allow-unsigned", action="store_true",
                         help="import a bundle that no trusted key signed: its native code will run in your processes")
    warm = command(commands, "prewarm", prewarm_command,
                   "compile every op entry of a manifest (recorded with AOTI_EAGER_RECORD) that the cache lacks "
                   "(its region entries need their model: aoti_eager.prewarm(manifest, model=...))")
    warm.add_argument("manifest", type=Path, help="recorded with enable(record=...) or $AOTI_EAGER_RECORD")
    warm.add_argument("--jobs", "-j", type=int, help="compiles at once (default: from cores and memory)")
    warm.add_argument("--devices", nargs="+", choices=["cpu", "cuda"], help="only these devices' entries")
    fleet = commands.add_parser("remote", help="the fleet cache (a Redis server, $AOTI_EAGER_REMOTE)").add_subparsers(
        dest="action", required=True)
    for sub in (command(fleet, "stats", remote_stats, "entries and bytes the server holds, by op"),
                command(fleet, "push", remote_push, f"publish the local cache's entries, signed with ${settings.signing_key.name}"),
                pull := command(fleet, "pull", remote_pull, "fetch an op's entries for this machine into the local cache, "
                                "each verified against the trusted keys")):
        sub.add_argument("--url", help=f"the server (default: ${settings.remote.name})")
    pull.add_argument("--op", type=_op, required=True, help="the op (aten::add.Tensor)")
    command(commands, "doctor", doctor, "check the environment (torch, compiler, ISA, CUDA, cache, C++ extension), then compile, load and run one kernel per device")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args.cache_dir or default_root(), args) or 0
    except Exception as e:  # noqa: BLE001 - every failure is one line; --debug shows the traceback
        if args.debug:
            raise
        if isinstance(e, _EXPECTED):
            message = str(e)
        else:
            message = f"unexpected {type(e).__name__}: {e} (run with --debug for the traceback, and report it)"
        if args.json:
            print(json.dumps({"error": message}))
        else:
            print(f"aoti-eager: {message}".replace("\n", " "), file=sys.stderr)
        return 1


# Failures that name their cause (a file, a setting, a bundle): reported as they are.
_EXPECTED = (OSError, ValueError, bundle.BadBundle, signing.SignatureError, signing.KeyFileError, remote.ServerUnavailable)


if __name__ == "__main__":
    sys.exit(main())
