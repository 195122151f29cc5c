#!/bin/sh
# The local documents of training-data/qwen2.5-coder-1.5b/documents (one path a
# line): Python's standard library (its modules and packages, not its test
# suite, IDLE, lib2to3, tkinter demos or bundled wheels), the READMEs and
# notes under /usr/share/doc, and the descriptions of the installed packages
# (their METADATA: most hold the package's README). Licence texts, change logs
# and release news are left out.
# Usage (bash; one path holds a space): mapfile -t C < <(sh training-data/local_documents.sh)
#   forerun train data ... --corpus "${C[@]}"
set -eu
PY=${PYTHON:-python3}
STD=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for f in "$STD"/*.py; do
    case "$(basename "$f")" in
        _sysconfigdata*|this.py|antigravity.py|__hello__.py) ;;
        *) echo "$f" ;;
    esac
done
for d in asyncio collections concurrent ctypes curses dbm email html http importlib json \
         logging multiprocessing pydoc_data re sqlite3 tomllib unittest urllib venv wsgiref \
         xml xmlrpc zoneinfo; do
    [ -d "$STD/$d" ] && echo "$STD/$d"
done
find /usr/share/doc -type f \( -iname 'readme*' -o -name '*.md' -o -name '*.txt' \
    -o -name '*.rst' \) ! -name '*.gz' ! -iname '*licen[cs]e*' ! -iname '*copying*' \
    ! -iname '*copyright*' ! -iname '*changelog*' ! -iname 'news*' 2>/dev/null | sort
ls "$SITE"/*.dist-info/METADATA 2>/dev/null | sort
