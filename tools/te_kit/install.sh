#!/usr/bin/env bash
# On the GPU machine, from the repo root, with .te_kit carried (docs/te-on-device.md):
#   bash tools/te_kit/install.sh && export PYTHONPATH=/tmp/te_site:$PYTHONPATH
# Installs Transformer Engine 2.11 into /tmp/te_site (once per machine). Without a built
# torch extension in .te_kit it compiles one (a few minutes) and writes the wheel to $OUT,
# to be copied into .whl/te_built/ here so later sessions skip the compile.
set -euo pipefail
site=/tmp/te_site kit=$PWD/.te_kit
[ -f "$site/.te-ready" ] && { echo "TE already in $site"; exit 0; }
mkdir -p "$site"
xz -dc "$kit/te_core_sm90.tar.xz" | tar -C "$site" -xf -
# Wheels are unzipped, not pip-installed: the core and the meta wheel share the
# transformer_engine/ folder, and pip --target skips a folder that already exists.
unpack() { for w in "$@"; do python3 -m zipfile -e "$w" "$site"; done; }
unpack "$kit"/*.whl
if ! ls "$kit"/transformer_engine_torch-*.whl >/dev/null 2>&1; then
  src=$(mktemp -d) && tar xzf "$kit"/transformer_engine_torch-*.tar.gz -C "$src"
  # torch's CUDA 13 wheels bring cuDNN and NCCL headers as pip packages (nvidia/*/include),
  # which TE's build does not look for when a CUDA toolkit is present.
  CPATH=$(python3 -c 'import nvidia, pathlib; print(":".join(sorted(str(p) for d in nvidia.__path__ for p in pathlib.Path(d).glob("*/include"))))')
  export CPATH PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  time NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=$(nproc) \
      python3 -m pip wheel -q --no-build-isolation --no-deps -w "$src/built" "$src"/*/
  unpack "$src"/built/*.whl
  # Back to this machine through $OUT (files of at most 16 MiB come back).
  if [ -n "${OUT:-}" ]; then
    whl=$(ls "$src"/built/*.whl)
    split -b 15M -d -a 1 "$whl" "$OUT/$(basename "$whl").part" && ls -la "$OUT"/*.part*
  fi
fi
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} python3 -c \
  "import transformer_engine.pytorch as te, transformer_engine; print('TE', transformer_engine.__version__, 'in $site')"
touch "$site/.te-ready"
