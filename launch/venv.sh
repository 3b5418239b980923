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
