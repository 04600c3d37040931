"""The ``aoti-eager`` command line (also ``python -m aoti_eager``).

Exit codes: 0 success, 1 problems found (``cache verify``, ``doctor``, an entry
``prewarm`` could not compile) or a failure, 2 a usage error. A failure is one
line on stderr (with ``--json``, an object with an ``error`` field on stdout);
``--debug`` shows its traceback instead.

Here are the parser, ``prewarm`` and ``doctor``; the ``cache`` and ``remote``
commands are :mod:`aoti_eager._cli_cache`'s.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

from aoti_eager import settings
from aoti_eager._cli_cache import (
    cache_clear, cache_export, cache_import, cache_keygen, cache_list, cache_prune, cache_stats, cache_verify,
    remote_pull, remote_push, remote_stats,
)
from aoti_eager.cache import bundle, default_root, remote, signing
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
