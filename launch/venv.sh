# Sourced by the launch scripts: makes ./.venv (or $COPE_VENV) from a requirements file,
# reinstalling only when the pinned set changes (its hash is stamped into the venv).
ensure_venv() {
  local req="$1" venv="${COPE_VENV:-.venv}"
  local stamp="$venv/.stamp-$(basename "$req")"
  local want
  want=$(cat requirements*.txt | sha256sum | cut -c1-16)
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing $req into $venv ..." >&2
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -r "$req"
    echo "$want" > "$stamp"
  fi
  PY="$venv/bin/python"
}

# The CUDA compiler for `launch.plan`'s GPU targets, outside JAX's plugin discovery (see the file).
ensure_gpu_compiler() {
  local venv="${COPE_VENV:-.venv}" want
  local stamp="$venv/.stamp-gpu-compiler"
  want=$(cat requirements-gpu-compiler.txt | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing the GPU compiler into $venv/gpu-compiler ..." >&2
    rm -rf "$venv/gpu-compiler"
    "$venv/bin/python" -m pip install -q --no-deps --target "$venv/gpu-compiler" -r requirements-gpu-compiler.txt
    echo "$want" > "$stamp"
  fi
}
