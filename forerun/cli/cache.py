"""``forerun cache``: see what forerun's cache holds and reclaim its space.

* ``forerun cache list``: every entry (presets, converted and packed models,
  GGUF headers, compiled kernels) with its size, last use and state;
* ``forerun cache size``: the total, and per kind;
* ``forerun cache prune``: delete stale temporaries, unheld lock files and
  entries that are damaged, incomplete or from another version
  (``--unused-days N``: also entries unused for N days; ``--calibrations``:
  also what forerun measured on this machine, so that it is measured
  again; ``--all``: every entry; ``--dry-run``: only say what would go);
* ``forerun cache verify``: checksum every file of every entry;
* ``forerun cache path``: print the cache directory.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from forerun.errors import ForerunError
from forerun.loading.cache_inventory import prune_digests, removable, remove, scan
from forerun.machine.paths import cache_dir


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="list, verify or prune forerun's cache",
                       description=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="cache_command", required=True)
    actions.add_parser("list", help="every entry with its size, last use and state")
    actions.add_parser("size", help="the total size, and per kind")
    prune = actions.add_parser("prune", help="delete what is stale, damaged or unused")
    prune.add_argument("--unused-days", type=float, default=None, metavar="N",
                       help="also delete entries not used for N days")
    prune.add_argument("--calibrations", action="store_true",
                       help="also delete what forerun measured on this machine (weight "
                            "formats, kernels, verification costs): measured again when "
                            "next needed, best on an idle machine")
    prune.add_argument("--all", action="store_true",
                       help="delete every entry (the cache is rebuilt as needed)")
    prune.add_argument("--dry-run", action="store_true",
                       help="only print what would be deleted")
    actions.add_parser("verify", help="checksum every file of every entry")
    actions.add_parser("path", help="print the cache directory")


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _age(seconds_since_epoch: float) -> str:
    if not seconds_since_epoch:
        return "-"
    days = (time.time() - seconds_since_epoch) / 86400
    return "today" if days < 1 else f"{days:.0f} days ago"


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    root = cache_dir()
    action = args.cache_command
    if action == "path":
        print(root)
        return 0
    items = scan(root, checksums="all" if action == "verify" else "none")
    if action == "list":
        if not items:
            print(f"{root} is empty")
            return 0
        rows = [("kind", "name", "size", "last used", "state")]
        rows += [(i.kind, i.name, human_size(i.size), _age(i.last_used), i.state)
                 for i in items]
        print(_table(rows))
        print(f"\n{len(items)} items, {human_size(sum(i.size for i in items))} in {root}")
        return 0
    if action == "size":
        kinds: dict[str, int] = {}
        for i in items:
            kinds[i.kind] = kinds.get(i.kind, 0) + i.size
        for kind, size in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"{kind:12} {human_size(size):>10}")
        print(f"{'total':12} {human_size(sum(kinds.values())):>10}  ({root})")
        return 0
    if action == "verify":
        bad = [i for i in items if i.entry is not None and not i.ok]
        for i in bad:
            print(f"{i.path}: {i.state}")
        checked = sum(1 for i in items if i.entry is not None)
        print(f"{checked} entries checked, {len(bad)} damaged"
              + ("; they are rebuilt when next used, or run 'forerun cache prune'"
                 if bad else ""))
        return 1 if bad else 0
    if args.unused_days is not None and not args.unused_days >= 0:
        raise ForerunError(f"--unused-days must be a number >= 0, got {args.unused_days}")
    doomed = [i for i in items
              if removable(i, unused_days=args.unused_days, everything=args.all,
                           calibrations=args.calibrations)]
    freed = 0
    for i in doomed:
        print(f"{'would delete' if args.dry_run else 'deleting'} {i.kind} {i.path} "
              f"({human_size(i.size)}, {i.state})")
        if not args.dry_run:
            remove(i)
        freed += i.size
    digests = root / "digests"
    if not args.dry_run and digests.is_dir() and not any(i.kind == "digests" for i in doomed):
        prune_digests(digests)
    print(f"{'would free' if args.dry_run else 'freed'} {human_size(freed)}")
    return 0
