"""Local texts for the draft-head conversations of ``conversations.py``, read
from this machine's filesystem only (no network), in two kinds:

* ``document``: English technical text a user might paste into a chat and ask
  about: package descriptions (``*.dist-info/METADATA``), READMEs and docs under
  /usr/share/doc, Python's standard library (docstrings, source), English man
  pages; 300 to 6000 characters, no source type over ~40 % of them.
* ``translate``: non-English text to translate into English, with its language:
  gettext catalogues' msgstr values, non-English man pages.

License texts, non-text, English where it should not be, exact duplicates and
overlaps with forerun's benchmark prompts (``BenchOverlap``) are dropped.  Out:
xz-compressed JSON lines ``{"kind", "text", "lang", "source"}``, shuffled.
"""

from __future__ import annotations

import argparse
import ast
import gettext
import gzip
import itertools
import json
import lzma
import math
import re
import sys
import sysconfig
import unicodedata
from collections import Counter, defaultdict
from pathlib import Path
from random import Random

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from forerun.bench.prompts import load_prompts  # noqa: E402
from forerun.training.magpie import BenchOverlap  # noqa: E402

# the running Python's packages and standard library
SITE, STDLIB = Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["stdlib"])
DOC, MAN = Path("/usr/share/doc"), Path("/usr/share/man")
MAX_DOCS, MAX_TRANSLATE, MAX_SHARE = 5000, 6000, 0.4
PER_FILE, PER_MAN, PER_FAMILY, PER_CATALOGUE, MIN_LANG = 30, 4, 60, 12, 40
LICENSE = re.compile(r"permission is hereby granted|gnu (lesser |library )?general public "
                     r"licen[cs]e|without any warranty|redistribution and use in source|"
                     r"licensed under the apache|no warranty|\bgpl", re.I)
DOC_NAME = re.compile(r"(readme|faq|bugs|todo|\.txt|\.md|\.rst)(\.gz)?$", re.I)
FORMAT = re.compile(r"%[-+ #0-9.*]*[hlLqjzt]*[a-zA-Z%]|\{[^}]*\}|<[^>]*>|\$\{?\w+\}?")
WORD = re.compile(r"[^\W\d_]{2,}")
STOP = set("the of and to that for with this are from which will when was its into does than "
           "then these there their they you your should would such must".split())
END = re.compile(r"see also|authors?|colophon|reporting bugs|copyright|bugs", re.I)
RNG = Random(0)


# -- text helpers --------------------------------------------------------------
def pack(units: list[str], lo: int, hi: int, sep: str = "\n\n") -> list[str]:
    """Join consecutive units into pieces of at most ``hi`` characters, keeping
    those of at least ``lo``; a unit over ``hi`` is split at its lines."""
    out, cur = [], ""
    for unit in units:
        if len(unit) > hi:
            out += pack(unit.split("\n"), lo, hi, "\n") if "\n" in unit else []
            continue
        if cur and len(cur) + len(sep) + len(unit) > hi:
            out, cur = out + [cur], ""
        cur = cur + sep + unit if cur else unit
    return [p for p in out + [cur] if len(p) >= lo]


def paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


def letter_share(text: str) -> float:
    return sum(c.isalpha() or c.isspace() for c in text) / max(len(text), 1)


def prose(text: str) -> bool:
    """Mostly letters and spaces, with a sentence end every 500 characters
    (not a table, a list of names or a hex dump)."""
    ends = len(re.findall(r"\w[.!?](?=\s|$)", text))
    return letter_share(text) >= 0.6 and ends * 500 >= len(text)


def stop_share(text: str) -> float:
    """The share of English function words (the, of, which ...) in ``text``."""
    words = WORD.findall(text.lower())
    return sum(w in STOP for w in words) / max(len(words), 1)


def read(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


ACCENT = {":": "\u0308", "'": "\u0301", "`": "\u0300", "^": "\u0302", ",": "\u0327", "~": "\u0303"}
GLYPH = dict(zip("em en hy aq dq lq rq oq cq bu co rg tm mu de ss oa oA /o /O ae AE Fo Fc ti ha "
                 "rs fo fc lA rA ->".split(), "—–-'\"“”‘’•©®™×°ßåÅøØæÆ«»~^\0‹›⇐⇒→"))
TEXT_MACROS = set("B I SM SB BR IR RB RI BI IB UR MT Nm Nd Op Fl Ar Pa Xr Dq Ql Sq Em Cm Va Ev "
                  "Fn Fa Ft Li Dv Er Ic Ad Sy It Dl Aq Pq Bq Qq Lk Mt OP".split())
ALTERNATING = set("BR IR RB RI BI IB".split())
BREAK_MACROS = set("PP P LP IP TP TQ HP sp br Pp RS RE nf fi Sp Vb Ve Bl El Bd Ed EX EE".split())


def troff_char(name: str) -> str:
    """A groff special character: \\(:a, \\[u00E4], \\(em ..."""
    if name[:1] in ACCENT and len(name) == 2:
        return unicodedata.normalize("NFC", name[1] + ACCENT[name[0]])
    if re.fullmatch(r"u[0-9A-F]{4,5}", name):
        return chr(int(name[1:], 16))
    return GLYPH.get(name, "")


def troff_inline(line: str) -> str:
    line = re.sub(r'\\".*', "", line)
    line = re.sub(r"\\\((..)|\\\[([^]]*)\]", lambda m: troff_char(m.group(1) or m.group(2)), line)
    line = re.sub(r"\\f(\(..|\[[^]]*\]|.)|\\s[-+]?\d+|\\\*(\(..|\[[^]]*\]|.)|\\n(\(..|.)", "", line)
    line = re.sub(r"\\[hvwoklLDNXZbx]'[^']*'", "", line)
    line = line.replace("\\-", "-").replace("\\e", "\0").replace("\\ ", " ").replace("\\~", " ")
    return re.sub(r"\\.", "", line).replace("\0", "\\")  # \0 stands for a backslash


def man_paragraphs(source: str) -> list[str]:
    """Crude troff to plain paragraphs: headings and paragraph macros break,
    font macros keep their words, other requests are dropped."""
    out, cur, fill, skip = [], [], True, False

    def flush() -> None:
        if text := (" " if fill else "\n").join(cur).strip():
            out.append(re.sub(r"[ \t]+", " ", text))
        cur.clear()

    for line in source.splitlines():
        if skip:  # inside a macro definition, an .ig block or a table
            skip = not line.startswith(("..", ".TE"))
            continue
        if not line.startswith((".", "'")):
            if line.strip():
                cur.append(troff_inline(line))
            else:
                flush()
            continue
        name, _, rest = line[1:].strip().partition(" ")
        args = [a or b for a, b in re.findall(r'"((?:[^"]|"")*)"|(\S+)', troff_inline(rest))]
        if name in ("de", "ig", "TS"):
            skip = True
        elif name in ("SH", "SS", "Sh", "Ss"):
            flush()
            out.append(" ".join(args))
        elif name in BREAK_MACROS:
            flush()
            fill = name not in ("nf", "Vb", "EX") and (name in ("fi", "Ve", "EE") or fill)
            if name == "IP" and args and args[0] not in ("•", "-"):
                cur.append(args[0])
        elif name in TEXT_MACROS:
            cur.append(("" if name in ALTERNATING else " ").join(
                a for a in args if a not in TEXT_MACROS))
    flush()
    return out


# -- documents -----------------------------------------------------------------
def metadata_documents():
    for meta in sorted(SITE.glob("*.dist-info/METADATA")):
        if len(text := meta.read_text("utf-8", "replace").partition("\n\n")[2]) >= 300:
            yield "metadata", meta, pack(paragraphs(text), 300, 6000)


def usr_doc_documents():
    for path in sorted(DOC.rglob("*")):
        skip = re.search(r"copyright|changelog|news|relnotes|license|/examples?/|/tests?/",
                         str(path), re.I)
        if path.is_file() and not path.is_symlink() and DOC_NAME.search(path.name) and not skip:
            if text := read(path):
                yield "usr-share-doc", path, pack(paragraphs(text), 300, 6000)


def stdlib_documents():
    for path in sorted(STDLIB.glob("*.py")):
        source = path.read_text("utf-8", "replace")
        if len(doc := ast.get_docstring(ast.parse(source)) or "") >= 300:
            yield "stdlib-docstring", f"{path}:docstring", pack(paragraphs(doc), 300, 6000)
        if len(source) <= 6000:  # a whole module, else slices at def/class boundaries
            yield "stdlib-source", path, [source] if len(source) >= 300 else []
            continue
        tops = re.split(r"\n(?=(?:@|def |class |async def )\S)", source)
        units = [u for top in tops for u in re.split(r"\n(?=    (?:@|def |async def )\S)", top)]
        yield "stdlib-source", path, pack(units, 300, 6000, "\n")


def man_documents():
    """English man pages, at most PER_FAMILY per family (gcloud has 16,000),
    up to their SEE ALSO / AUTHOR sections."""
    families, files = Counter(), sorted(MAN.glob("man*/*"))
    RNG.shuffle(files)
    for path in files:
        family = re.split(r"[-_.]", path.name)[0]
        if path.is_symlink() or families[family] >= PER_FAMILY:
            continue
        if (source := read(path)) and not source.startswith(".so"):
            families[family] += 1
            paras = man_paragraphs(source)
            end = next((i for i, p in enumerate(paras) if END.fullmatch(p)), len(paras))
            yield "man", path, pack(paras[:end], 300, 6000)


def documents(keep) -> list[dict]:
    """Pieces of every document source, no type over MAX_SHARE of the whole."""
    groups = defaultdict(list)
    for gather in (metadata_documents, usr_doc_documents, stdlib_documents, man_documents):
        for kind, path, pieces in gather():
            ok = [(i, p) for i, p in enumerate(pieces) if not LICENSE.search(p)
                  and (kind == "stdlib-source" or prose(p) and stop_share(p) >= 0.03)]
            groups[kind] += [{"kind": "document", "text": p, "lang": "English", "type": kind,
                              "source": f"{path}#{i}"}
                             for i, p in some(ok, PER_MAN if kind == "man" else PER_FILE)]
    for items in groups.values():
        RNG.shuffle(items)
    total = MAX_DOCS  # the largest total in which no type is over MAX_SHARE
    while (fit := sum(min(len(v), int(MAX_SHARE * total)) for v in groups.values())) < total:
        total = fit
    return balanced(groups, dict.fromkeys(groups, int(MAX_SHARE * total)), total, keep)


def some(pieces: list, n: int) -> list:
    """At most ``n`` of a file's pieces, chosen at random, in file order."""
    return sorted(RNG.sample(pieces, min(len(pieces), n)))


def balanced(groups: dict[str, list], quota: dict[str, int], total: int, keep) -> list[dict]:
    """Items taken round-robin from the groups (each up to its quota) until
    ``total``, skipping those ``keep`` rejects."""
    taken, cursor, out = Counter(), Counter(), []
    while len(out) < total:
        live = [g for g in groups if cursor[g] < len(groups[g]) and taken[g] < quota[g]]
        if not live:
            break
        for g in live:
            item, cursor[g] = groups[g][cursor[g]], cursor[g] + 1
            if len(out) < total and keep(item["text"]):
                taken[g] += 1
                out.append(item)
    return out


# -- translation passages ------------------------------------------------------
def language(code: str, names: dict[str, str]) -> str | None:
    """The English name of a locale's language (pt_BR, sr@latin, uk.cp1251 ...)."""
    base = re.split(r"[_.@]", code)[0].lower()
    return names.get(base) if base not in ("en", "c") else None


def language_names() -> dict[str, str]:
    entries = json.loads(Path("/usr/share/iso-codes/json/iso_639-3.json").read_text())["639-3"]
    names = {e[k]: re.sub(r"\s*\(.*\)", "", e["name"]) for e in entries
             for k in ("alpha_3", "alpha_2") if k in e}
    return names | dict(el="Greek", pa="Punjabi", nb="Norwegian", no="Norwegian", ms="Malay")


def catalogues(names: dict[str, str]) -> list[tuple[Path, str, list[tuple[str, str]]]]:
    """(path, language, [(msgid, msgstr)]) of every readable catalogue but
    iso_* (names of countries, languages, currencies)."""
    out = []
    for path in sorted(Path("/usr/share").glob("**/LC_MESSAGES/*.mo")):
        lang = language(path.parent.parent.name, names)
        if not lang or path.name.startswith("iso_"):
            continue
        try:
            with open(path, "rb") as f:
                catalogue = gettext.GNUTranslations(f)._catalog
        except Exception:  # undecodable or malformed
            continue
        out.append((path, lang, [(k if isinstance(k, str) else k[0], v)
                                 for k, v in catalogue.items()
                                 if k and v and (isinstance(k, str) or k[1] == 0)]))
    return out


def english(text: str, vocab: set[str]) -> bool:
    """Mostly words of English msgids, or many English function words."""
    words = WORD.findall(text.lower())
    in_vocab = sum(w.isascii() and w in vocab for w in words)
    return in_vocab >= 0.5 * max(len(words), 1) or stop_share(text) >= 0.2


def catalogue_passages(cats, vocab):
    """1 to 4 consecutive translated sentences per passage, at most
    PER_CATALOGUE passages of a catalogue."""
    for path, lang, pairs in cats:
        good = [v.strip() for i, v in pairs if v != i and len(v) <= 1500 and not english(v, vocab)
                and len(WORD.findall(FORMAT.sub(" ", v))) >= 4 and letter_share(v) >= 0.6
                and not LICENSE.search(i + v)]
        passages, i = [], 0
        while i < len(good):
            n = RNG.randint(1, 4)
            passages, i = passages + pack(good[i:i + n], 1, 1500, "\n"), i + n
        yield "catalogue", lang, [(f"{path}#{j}", t) for j, t in
                                  some(list(enumerate(passages)), PER_CATALOGUE)]


def foreign_man_passages(names, vocab):
    """Paragraphs of non-English man pages (untranslated ones dropped), packed
    into 150-1500 characters, at most PER_MAN a page."""
    for path in sorted(MAN.glob("*/man*/*")):
        if path.is_symlink() or not (lang := language(path.parts[4], names)):
            continue
        if (source := read(path)) and not source.startswith(".so"):
            paras = [p for p in man_paragraphs(source) if not english(p, vocab)]
            yield "man", lang, [(f"{path}#{i}", p) for i, p in some(
                [(i, p) for i, p in enumerate(pack(paras, 150, 1500))
                 if prose(p) and not LICENSE.search(p)], PER_MAN)]


def translate_passages(keep) -> list[dict]:
    """Passages of the languages with at least MIN_LANG of them; a language's
    quota grows with the square root of what it has."""
    names = language_names()
    cats = catalogues(names)
    vocab = {w for _, _, pairs in cats for i, _ in pairs for w in WORD.findall(i.lower())}
    found = defaultdict(lambda: defaultdict(list))
    for kind, lang, items in itertools.chain(catalogue_passages(cats, vocab),
                                             foreign_man_passages(names, vocab)):
        found[lang][kind] += [{"kind": "translate", "text": t, "lang": lang, "source": s,
                               "type": kind} for s, t in items]
    groups = {}  # per language, man-page prose and catalogue strings alternately
    for lang, kinds in found.items():
        for items in kinds.values():
            RNG.shuffle(items)
        mixed = itertools.zip_longest(kinds["man"], kinds["catalogue"])
        if len(items := [x for pair in mixed for x in pair if x]) >= MIN_LANG:
            groups[lang] = items
    roots = {lang: math.sqrt(len(items)) for lang, items in groups.items()}
    quota = {lang: math.ceil(MAX_TRANSLATE * r / sum(roots.values())) for lang, r in roots.items()}
    return balanced(groups, quota, MAX_TRANSLATE, keep)


# -- main ----------------------------------------------------------------------
def bench_filter():
    """A ``keep(text)`` that drops duplicates (whitespace and case aside) and
    overlaps with any user turn of forerun's benchmark prompt files."""
    turns = [t for f in sorted((ROOT / "forerun/bench/prompts").glob("*.jsonl"))
             for p in load_prompts(f) for t in p.turns]
    bench, seen, dropped = BenchOverlap(turns), set(), Counter()

    def keep(text: str) -> bool:
        key = " ".join(text.lower().split())
        reason = "duplicate" if key in seen else "bench" if bench.overlaps(text) else None
        seen.add(key)
        dropped.update([reason] if reason else [])
        return reason is None
    return keep, dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "training-data/gpu/sources.jsonl.xz")
    args = parser.parse_args()
    keep, dropped = bench_filter()
    rows = documents(keep) + translate_passages(keep)
    Random(0).shuffle(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(args.out, "wt", encoding="utf-8", preset=9) as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in ("kind", "text", "lang", "source")},
                               ensure_ascii=False) + "\n")
    print("per kind:", dict(Counter(r["kind"] for r in rows)))
    print("per source type:", dict(Counter(f"{r['kind']}/{r['type']}" for r in rows)))
    print("per language:", dict(Counter(r["lang"] for r in rows).most_common()))
    print("dropped:", dict(dropped))
    print(f"{args.out}: {args.out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
