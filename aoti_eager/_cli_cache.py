"""The ``cache`` and ``remote`` commands of :mod:`aoti_eager.cli`: what the
local cache and the fleet cache hold, their upkeep (verify, prune, clear), and
moving entries between caches, signed bundles and machines.

Each command takes the cache's root and the parsed arguments, prints (JSON
with ``--json``) and returns the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from aoti_eager import settings
from aoti_eager.cache import bundle, inventory, remote, signing, store


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
