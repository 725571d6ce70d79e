# Shared steps of scripts/setup.sh and scripts/setup_vllm.sh, sourced by both: a venv is
# reused while a stamp file holds the hash of every input of its install.

# venv_current VENV STAMP HASH: true when VENV exists and its stamp matches HASH.
venv_current() {
  [ -f "$2" ] && [ "$(cat "$2")" = "$3" ] && [ -x "$1/bin/python" ]
}

# venv_with_torch PYTHON VENV TAG: create VENV with PYTHON if missing, then upgrade pip
# and install torch pinned exactly, since an unpinned torch resolves to a multi-GB CUDA
# build. Sets PIP for the caller.
venv_with_torch() {
  if [ ! -x "$2/bin/python" ]; then
    echo "$3: creating $2 with $($1 --version)"
    "$1" -m venv "$2"
  fi
  PIP="$2/bin/python -m pip --disable-pip-version-check"
  $PIP install -q --upgrade pip
  echo "$3: installing torch==2.13.0 (CPU wheel)"
  $PIP install -q "torch==2.13.0"
}
