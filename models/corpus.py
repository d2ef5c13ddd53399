"""Jane Austen's six novels as plain text, from Debian's ``r-cran-janeaustenr``.

On first use the .deb is fetched with ``apt-get download`` (no install), unpacked with
``dpkg-deb -x`` and the R lazy-load database ``data/Rdata.rdb``/``.rdx`` is decoded with the
``rdata`` package: the ``.rdx`` index is an R serialized object mapping each variable to an
(offset, length) slice of the ``.rdb`` file; each slice is a 4-byte big-endian length followed
by a zlib stream holding one R serialized character vector (one element per line of the book).
One UTF-8 text file per novel goes to ``<cache>/corpus/janeaustenr/``.

An installed R package (``/usr/lib/R/site-library/janeaustenr``) is used directly when present;
``ORTLEAN_JANEAUSTENR`` may point at a .deb file or an unpacked package directory instead.

    from models import corpus
    corpus.novels()                 # {"Emma": Path(...), ..., "Persuasion": Path(...)}
    corpus.text(corpus.EVAL_NOVEL)  # str
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

from .cache import atomic_dir, cache_root

__all__ = [
    "TITLES", "CALIB_NOVEL", "EVAL_NOVEL", "DEB_PACKAGE", "CorpusError",
    "corpus_dir", "ensure_corpus", "novels", "text", "read_lazyload_db",
]

DEB_PACKAGE = "r-cran-janeaustenr"
# R variable name -> title, as janeaustenr's austen_books() names the books.
TITLES: dict[str, str] = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
CALIB_NOVEL = "Sense & Sensibility"   # tune / calibrate on this one
EVAL_NOVEL = "Persuasion"             # evaluate on this one (never seen by calibration)

_R_SUBDIR = Path("usr/lib/R/site-library/janeaustenr")
_SYSTEM_R = Path("/usr/lib/R/site-library/janeaustenr")
_FORMAT = 1  # bump when the text layout written below changes


class CorpusError(RuntimeError):
    pass


def corpus_dir() -> Path:
    return cache_root() / "corpus" / "janeaustenr"


def _filename(title: str) -> str:
    return title.replace(" & ", "_and_").replace(" ", "_") + ".txt"


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[ortlean] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# R lazy-load database
def read_lazyload_db(data_dir: Path) -> dict[str, object]:
    """Decode every variable of an R lazy-load DB (``<data_dir>/Rdata.rdx`` + ``Rdata.rdb``)."""
    import rdata

    data_dir = Path(data_dir)
    rdx, rdb = data_dir / "Rdata.rdx", data_dir / "Rdata.rdb"
    if not rdx.is_file() or not rdb.is_file():
        raise CorpusError(f"no R lazy-load database in {data_dir} (expected Rdata.rdx and Rdata.rdb)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata warns about the .rdx extension / headerless data
        index = rdata.conversion.convert(rdata.parser.parse_file(rdx, extension="rds"))
        if not bool(index.get("compressed", [True])[0]):
            raise CorpusError(f"{rdx}: uncompressed lazy-load DBs are not supported")
        blob = rdb.read_bytes()
        out: dict[str, object] = {}
        for name, (offset, length) in index["variables"].items():
            chunk = blob[int(offset): int(offset) + int(length)]
            (n,) = struct.unpack(">I", chunk[:4])
            raw = zlib.decompress(chunk[4:])
            if len(raw) != n:
                raise CorpusError(f"{rdb}: variable {name}: expected {n} bytes, got {len(raw)}")
            out[str(name)] = rdata.conversion.convert(rdata.parser.parse_data(raw))
    return out


# ---------------------------------------------------------------------------------------------
# fetching
def _apt_download(dest: Path, progress: bool) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise CorpusError(
            f"the text corpus comes from Debian's package {DEB_PACKAGE}, but apt-get/dpkg-deb are "
            "not available here; download the .deb by hand and set ORTLEAN_JANEAUSTENR=/path/to/it.deb"
        )

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=dest,
                              capture_output=True, text=True)

    _say(progress, f"corpus: apt-get download {DEB_PACKAGE}")
    r = run()
    if r.returncode != 0 and ("Unable to locate" in r.stderr or "No packages found" in r.stderr
                              or "Can't select" in r.stderr):
        if os.geteuid() == 0:
            _say(progress, "corpus: package lists are missing; running apt-get update once")
            subprocess.run(["apt-get", "update"], capture_output=True, text=True)
            r = run()
        else:
            raise CorpusError(f"apt-get cannot find {DEB_PACKAGE}: run `sudo apt-get update` first")
    debs = sorted(dest.glob(f"{DEB_PACKAGE}_*.deb"))
    if r.returncode != 0 or not debs:
        raise CorpusError(f"`apt-get download {DEB_PACKAGE}` failed:\n{r.stderr.strip()}")
    return debs[-1]


def _package_dir(work: Path, progress: bool) -> tuple[Path, str]:
    """The janeaustenr R package directory and a description of where it came from."""
    env = os.environ.get("ORTLEAN_JANEAUSTENR")
    if env:
        p = Path(env)
        if p.is_dir():
            for cand in (p, p / _R_SUBDIR):
                if (cand / "data" / "Rdata.rdx").is_file():
                    return cand, f"dir:{cand}"
            raise CorpusError(f"ORTLEAN_JANEAUSTENR={env}: no data/Rdata.rdx under it")
        deb = p
    elif (_SYSTEM_R / "data" / "Rdata.rdx").is_file():
        return _SYSTEM_R, f"installed:{_SYSTEM_R}"
    else:
        deb = _apt_download(work, progress)
    if not deb.is_file():
        raise CorpusError(f"{deb}: no such file")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "x")], check=True)
    return work / "x" / _R_SUBDIR, deb.name


def ensure_corpus(progress: bool = True) -> Path:
    """Directory holding one ``<Title>.txt`` per novel (fetched and decoded on first use)."""
    target = corpus_dir()
    if (target / "corpus.json").is_file():
        meta = json.loads((target / "corpus.json").read_text())
        if meta.get("format") == _FORMAT:
            return target
    t0 = time.monotonic()
    with atomic_dir(target, force=target.exists()) as tmp:
        if tmp is None:
            return target
        with tempfile.TemporaryDirectory(dir=tmp.parent, prefix=".janeaustenr-work-") as w:
            pkg, source = _package_dir(Path(w), progress)
            _say(progress, f"corpus: decoding R data from {source}")
            data = read_lazyload_db(pkg / "data")
            version = None
            desc = pkg / "DESCRIPTION"
            if desc.is_file():
                for line in desc.read_text(errors="replace").splitlines():
                    if line.startswith("Version:"):
                        version = line.split(":", 1)[1].strip()
        files = {}
        for var, title in TITLES.items():
            if var not in data:
                raise CorpusError(f"janeaustenr data has no variable {var!r} (has {sorted(data)})")
            lines = [str(x) for x in data[var]]
            txt = "\n".join(lines).strip() + "\n"
            (tmp / _filename(title)).write_text(txt, encoding="utf-8")
            files[title] = {"file": _filename(title), "r_name": var, "lines": len(lines), "chars": len(txt)}
        meta = {"format": _FORMAT, "source": source, "package": DEB_PACKAGE,
                "janeaustenr_version": version, "novels": files,
                "calib_novel": CALIB_NOVEL, "eval_novel": EVAL_NOVEL}
        (tmp / "corpus.json").write_text(json.dumps(meta, indent=1))
    _say(progress, f"corpus: {len(TITLES)} novels in {target} ({time.monotonic() - t0:.1f}s)")
    return target


def _resolve(title: str) -> str:
    if title in TITLES.values():
        return title
    key = title.lower().replace(" ", "").replace("&", "").replace("and", "")
    for var, t in TITLES.items():
        if key in (var, var.replace("and", "")) or title.lower() == t.lower():
            return t
    raise KeyError(f"unknown novel {title!r}: one of {list(TITLES.values())}")


def novels(progress: bool = False) -> dict[str, Path]:
    """Title -> text file (UTF-8, one line per line of the book), fetching on first use."""
    d = ensure_corpus(progress=progress)
    return {t: d / _filename(t) for t in TITLES.values()}


def text(title: str, progress: bool = False) -> str:
    """Full text of one novel; ``title`` as in :data:`TITLES` values (or the R name)."""
    return novels(progress)[_resolve(title)].read_text(encoding="utf-8")
