#!/usr/bin/env bash
# ONNX Runtime's C/C++ API headers for `k3x build-ort-kernels`, from Debian's libonnxruntime-dev package, copied
# into DEST (default .venv/include/onnxruntime, where k3x looks: <python prefix>/include/onnxruntime).
# Where apt offers libonnxruntime-dev (Debian 13 and later), it is installed as usual (headers in
# /usr/include/onnxruntime, found there). Debian 12 has no such package: the script downloads the one of the
# next release (its headers, API version 21, build the kernels that onnxruntime 1.21 and later load) through apt
# with a private state folder, from the Debian mirror this machine is already configured with, signed by the
# installed archive keyring; nothing is installed from that release and the system's apt setup is left as it is.
set -euo pipefail
dest=${1:-.venv/include/onnxruntime}
if [ -f /usr/include/onnxruntime/onnxruntime_cxx_api.h ] || [ -f "$dest/onnxruntime_cxx_api.h" ]; then
  exit 0
fi
apt-get update -qq
if apt-cache policy libonnxruntime-dev | grep -q 'Candidate: [0-9]'; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libonnxruntime-dev >/dev/null
  exit 0
fi
. /etc/os-release
mirror=$(apt-cache policy | awk -v s="$VERSION_CODENAME/main" '$3 == s {print $2; exit}')
[ -n "$mirror" ] || { echo "ort_headers: no Debian mirror configured for $VERSION_CODENAME/main" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chown _apt "$work" 2>/dev/null || true  # apt downloads as its own user
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" >"$work/sources.list"
opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/nonexistent
      -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Dir::State::Status=/dev/null)
apt-get "${opts[@]}" update -qq
(cd "$work" && apt-get "${opts[@]}" download libonnxruntime-dev >/dev/null)
dpkg-deb -x "$work"/libonnxruntime-dev_*.deb "$work/root"
mkdir -p "$dest"
cp "$work"/root/usr/include/onnxruntime/*.h "$dest/"
