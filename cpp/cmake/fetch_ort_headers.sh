#!/bin/sh
# Fetch ONNX Runtime C/C++ headers from Debian trixie's libonnxruntime-dev (ORT 1.21, C API 21)
# into a directory of the build tree, without touching the system's apt state:
# private sources list, lists, cache and (read-only) status file; `apt-get download` needs no root.
#
#   fetch_ort_headers.sh <workdir>
# On success prints the include directory (holding onnxruntime_c_api.h) on the last stdout line.
set -eu

work=${1:?usage: fetch_ort_headers.sh <workdir>}
mkdir -p "$work"
work=$(cd "$work" && pwd)
suite=${ORTLEAN_ORT_SUITE:-trixie}
mirror=${ORTLEAN_DEBIAN_MIRROR:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)

find_header() {
    # the dev package puts them in usr/include/onnxruntime (older layouts: .../core/session)
    f=$(find "$work/root" -name onnxruntime_c_api.h 2>/dev/null | head -n 1)
    [ -n "$f" ] && dirname "$f"
}

if d=$(find_header) && [ -f "$d/onnxruntime_cxx_api.h" ]; then
    echo "$d"; exit 0
fi

command -v apt-get >/dev/null 2>&1 || { echo "fetch_ort_headers: apt-get not available" >&2; exit 1; }
command -v dpkg-deb >/dev/null 2>&1 || { echo "fetch_ort_headers: dpkg-deb not available" >&2; exit 1; }

mkdir -p "$work/etc/sources.list.d" "$work/etc/preferences.d" "$work/state/lists/partial" \
         "$work/cache/archives/partial" "$work/debs" "$work/root"

if [ -r "$keyring" ]; then
    signed="Signed-By: $keyring"
else
    echo "fetch_ort_headers: $keyring missing; cannot verify $suite" >&2; exit 1
fi
cat > "$work/etc/sources.list.d/ortlean.sources" <<SRC
Types: deb
URIs: $mirror
Suites: $suite
Components: main
$signed
SRC
: > "$work/etc/sources.list"

APT_OPTS="-o Dir::Etc::SourceList=$work/etc/sources.list \
 -o Dir::Etc::SourceParts=$work/etc/sources.list.d \
 -o Dir::Etc::Preferences=$work/etc/preferences \
 -o Dir::Etc::PreferencesParts=$work/etc/preferences.d \
 -o Dir::State::Lists=$work/state/lists \
 -o Dir::State::status=/var/lib/dpkg/status \
 -o Dir::Cache=$work/cache \
 -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= \
 -o APT::Architecture=$arch -o APT::Architectures=$arch \
 -o Acquire::Languages=none -o Acquire::IndexTargets::deb::Contents-deb::DefaultEnabled=false \
 -o Debug::NoLocking=1 -o APT::Sandbox::User=$(id -un) -q"

# shellcheck disable=SC2086
apt-get $APT_OPTS update >&2
cd "$work/debs"
# libonnxruntime-dev holds the headers; fetch libonnxruntime-dev only (headers are arch-indep
# text; the runtime .so of the package is never used).
# shellcheck disable=SC2086
apt-get $APT_OPTS download libonnxruntime-dev >&2
for deb in "$work"/debs/*.deb; do
    dpkg-deb -x "$deb" "$work/root"
done
d=$(find_header) || { echo "fetch_ort_headers: onnxruntime_c_api.h not in the package" >&2; exit 1; }
[ -f "$d/onnxruntime_cxx_api.h" ] || { echo "fetch_ort_headers: onnxruntime_cxx_api.h missing in $d" >&2; exit 1; }
echo "$d"
