# Sourced (from the repo root) by the GPU scripts: the repo on PYTHONPATH, torchrun beside
# python3, and the wheels carried to a device machine without internet in .whl/ (git-ignored),
# fetched here for Python 3.12 with:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
#     torchtitan==0.2.2 tyro torchdata datasets tomli dill multiprocess docstring-parser typeguard shtab xxhash fsspec
# FD_GPU_ENV_READY: an outer script installed them already (two scripts at once would race).
if [[ -z "${FD_GPU_ENV_READY:-}" ]] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"
export FD_GPU_ENV_READY=1
