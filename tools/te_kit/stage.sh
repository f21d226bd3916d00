#!/usr/bin/env bash
# Here (a machine with the package registry): build .te_kit/, everything Transformer Engine
# 2.11 needs on the GPU machine (Python 3.12, CUDA 13, no registry), small enough (~25 MB)
# to travel in one device call next to .device. See docs/te-on-device.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.whl/ /.te_kit/; do
  grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
dl=.whl/te && mkdir -p "$dl"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dl" \
    transformer_engine_cu13==2.11.0 transformer_engine==2.11.0 \
    pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 \
    typing-inspection==0.4.2 importlib-metadata==8.7.0
# The torch extension is an sdist; pip download would try to build its metadata (needs
# CUDA), so fetch the file from the index directly.
sdist=transformer_engine_torch-2.11.0.tar.gz
if [ ! -f "$dl/$sdist" ]; then
  url=$(curl -sS https://pypi.org/simple/transformer-engine-torch/ \
        | grep -o "https://[^\"#]*$sdist" | head -1)
  curl -sSL -o "$dl/$sdist" "$url"
fi

kit=.te_kit && rm -rf "$kit" && mkdir -p "$kit"
# The core wheel, unpacked, its library reduced to Hopper code (179 MB -> ~20 MB as .tar.xz).
core=$(mktemp -d) && trap 'rm -rf "$core"' EXIT
python3 -m zipfile -e "$dl"/transformer_engine_cu13-2.11.0-*.whl "$core"
lib="$core/transformer_engine/wheel_lib/libtransformer_engine.so"
python3 tools/te_kit/keep_one_arch.py --arch 90 "$lib" "$lib"
tar -C "$core" -cf - . | xz -9 -T0 > "$kit/te_core_sm90.tar.xz"
cp "$dl"/transformer_engine-2.11.0-*.whl "$dl"/pydantic*.whl "$dl"/annotated_types-*.whl \
   "$dl"/typing_inspection-*.whl "$dl"/importlib_metadata-*.whl "$kit"/
# A torch extension built on the GPU machine by an earlier session saves the compile.
if ls .whl/te_built/transformer_engine_torch-*.whl >/dev/null 2>&1; then
  cp .whl/te_built/transformer_engine_torch-*.whl "$kit"/
else
  cp "$dl/$sdist" "$kit"/
fi
du -sh --apparent-size "$kit" && ls -la "$kit"
