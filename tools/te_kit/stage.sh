#!/usr/bin/env bash
# Here (a machine with the package registry): download Transformer Engine 2.11 for the GPU
# machine (Python 3.12, CUDA 13, no registry) and split it into parts that each fit one
# device call's 64 MiB carry. See docs/te-on-device.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -q '^/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
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
# Three carries of < 61 MiB each: the core wheel in three equal pieces, the small files
# spread over them.
core=$(ls "$dl"/transformer_engine_cu13-*.whl)
rm -rf .whl/te1 .whl/te2 .whl/te3 && mkdir -p .whl/te1 .whl/te2 .whl/te3
split -n 3 -d -a 1 "$core" .whl/te_core.part
for i in 0 1 2; do mv .whl/te_core.part$i .whl/te$((i + 1))/; done
sha256sum "$core" | sed "s#$dl/##" > .whl/te3/core.sha256
cp "$dl"/pydantic_core-*.whl .whl/te1/
cp "$dl"/transformer_engine-2.11.0-*.whl "$dl/$sdist" .whl/te2/
cp "$dl"/pydantic-2*.whl "$dl"/annotated_types-*.whl "$dl"/typing_inspection-*.whl \
   "$dl"/importlib_metadata-*.whl .whl/te3/
du -sh --apparent-size .whl/te1 .whl/te2 .whl/te3
