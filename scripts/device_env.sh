# Sourced by the scripts/gpu_*.sh device scripts, from the repository root: make sure this checkout and what it
# needs import.  On a GPU machine set up as docs/DEVELOPING.md says (`pip install -e .`, which installs diffusers
# and the rest) there is nothing to install.  A machine that cannot fetch packages (the device tool's) carries
# them as wheels in the folder WHEELS (default .whl, ignored by git: diffusers, and optionally the peers fa3-fwd
# and sageattention, whose tests and benchmark rows skip without them): when it holds wheels they are installed
# into a fresh temporary site, and this checkout editable.  A WHEELS named explicitly must hold wheels.
if [[ -n "${WHEELS:-}" ]] && ! compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "$0: WHEELS=$WHEELS holds no wheels (*.whl); leave WHEELS unset to use what is installed" >&2
  exit 2
fi
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
if ! problem=$(python -c "import torch, triton, pasa_diffusers.pipelines.svd" 2>&1); then  # as the suite runs
  echo "$0: the package or what it needs does not import ($(tail -1 <<< "$problem")): pip install -e . first" \
       "(docs/DEVELOPING.md), or put the wheels it lacks in $WHEELS/ (scripts/README.md)" >&2
  exit 2
fi
