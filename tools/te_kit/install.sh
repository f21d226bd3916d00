#!/usr/bin/env bash
# On the GPU machine, in the repo root, after the three carries of docs/te-on-device.md:
#   bash tools/te_kit/install.sh collect .whl/te1     (call 1; likewise te2, te3)
#   bash tools/te_kit/install.sh build                (same call as te3, or the next)
# Installs TE into /tmp/site (the kit's site dir) and writes the built torch-extension wheel
# to $OUT in <16 MiB parts, to fetch back for later sessions.
set -euo pipefail
kit=/tmp/te_kit && mkdir -p "$kit"
case "$1" in
  collect) cp "$2"/* "$kit"/ && ls -la "$kit" ;;
  build)
    cd "$kit"
    core=$(cut -d' ' -f3 core.sha256)
    cat te_core.part0 te_core.part1 te_core.part2 > "$core"
    sha256sum -c core.sha256
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ./*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    rm -rf src && mkdir src && tar xzf transformer_engine_torch-2.11.0.tar.gz -C src
    # Hopper only: one architecture keeps the build inside one call.
    NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=16 \
        python3 -m pip wheel -q --no-build-isolation --no-deps -w "$kit/built" src/*/
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$kit"/built/*.whl
    python3 -c "import transformer_engine.pytorch as te; print('TE', te.__version__ if hasattr(te, '__version__') else 'ok')"
    if [ -n "${OUT:-}" ]; then
      split -b 15000000 -d -a 1 "$kit"/built/*.whl "$OUT/te_torch_built.part"
      ls "$kit"/built/ > "$OUT/te_torch_built.name"
    fi ;;
  *) echo "usage: install.sh collect DIR | build" >&2; exit 2 ;;
esac
